"""OpenEnv environments in slime's rollout: the generate function, its group filter, the
episode client and the token-checked server helper. Needs ``pip install slime[openenv]``.

    --custom-generate-function-path slime.agent.openenv.generate
    --dynamic-sampling-filter-path slime.agent.openenv.keep_scored_groups
"""

from slime.agent.openenv.rollout import failed_placeholder, generate, keep_scored_groups
from slime.agent.openenv.serve import BearerTokenMiddleware, serve_env
from slime.agent.openenv.session import END_TURN, START_EPISODE, EnvFailure, EnvSettings

__all__ = ["generate", "keep_scored_groups", "failed_placeholder", "serve_env", "BearerTokenMiddleware",
           "EnvSettings", "EnvFailure", "END_TURN", "START_EPISODE"]
