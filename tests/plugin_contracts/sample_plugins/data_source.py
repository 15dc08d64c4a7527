"""Sample ``--data-source-path``: the default source that also tags every sample with a source name."""

from slime.rollout.data_source import RolloutDataSourceWithBuffer


class TaggedDataSource(RolloutDataSourceWithBuffer):
    def __init__(self, args):
        super().__init__(args)

    def get_samples(self, num_samples):
        groups = super().get_samples(num_samples)
        for group in groups:
            for sample in group:
                sample.metadata.setdefault("source_name", "tagged")
        return groups
