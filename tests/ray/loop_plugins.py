"""Plugins the end-to-end loop tests name by dotted path (this directory is on the workers' PYTHONPATH)."""

REWARDED_TOKENS = set(range(0, 10_000, 2))


async def even_first_token_reward(args, sample, **kwargs) -> float:
    """1.0 when the first response token id is even: about half of a random model's samples, so
    GRPO has signal from the first step and the reward visibly rises within a few steps."""
    response_tokens = sample.tokens[len(sample.tokens) - sample.response_length:]
    return 1.0 if response_tokens and response_tokens[0] in REWARDED_TOKENS else 0.0


async def even_token_fraction_reward(args, sample, **kwargs) -> float:
    """The fraction of the response's tokens whose id is even: about 0.5 for a random model. Every
    response token carries signal (with a first-token reward the other tokens' log-prob gradients are
    pure noise), so GRPO learns it within a few steps on every seed (tests/ray/test_loop.py)."""
    response_tokens = sample.tokens[len(sample.tokens) - sample.response_length:]
    return sum(token in REWARDED_TOKENS for token in response_tokens) / len(response_tokens) if response_tokens else 0.0


# ---------------------------------------------------------------- fault injection

def _kill_engine_serving(url: str, signum: int | None = None) -> int:
    """Send ``signum`` (default SIGKILL) to the embedded-engine process listening on ``url``'s port;
    return its pid."""
    import os
    import signal

    signum = signal.SIGKILL if signum is None else signum
    port = url.rsplit(":", 1)[1]
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmdline = open(f"/proc/{pid}/cmdline", "rb").read().split(b"\0")
        except OSError:
            continue
        if b"slime.backends.embedded_engine" in cmdline and port.encode() in cmdline:
            os.kill(int(pid), signum)
            return int(pid)
    raise RuntimeError(f"no engine process found for {url}")


_fault_calls: dict[int, int] = {}


async def generate_and_hang_then_kill_engine(args, sample, sampling_params):
    """The default generate, except that the 6th call of rollout step 1 first SIGSTOPs engine 0 (the
    process stays alive and keeps its sockets, but answers nothing: a hung engine) and the 6th call
    of step 2 SIGKILLs it (a dead engine)."""
    import signal

    from slime.rollout.sample_hooks import get_current_rollout_id
    from slime.rollout.sglang_rollout import generate

    rollout_id = get_current_rollout_id()
    _fault_calls[rollout_id] = _fault_calls.get(rollout_id, 0) + 1
    if _fault_calls[rollout_id] == 6 and rollout_id in (1, 2):
        _kill_engine_serving(args.rollout_engine_urls[0], signal.SIGSTOP if rollout_id == 1 else signal.SIGKILL)
    return await generate(args, sample, sampling_params)


def kill_trainer_once_in_step_2(args, rollout_id, rollout_data):
    """A --rollout-data-postprocess-path hook (it runs on the training rank, in the middle of a step:
    after the log-prob passes, before the optimizer steps): SIGKILL this trainer process in step 2,
    the first time only (a marker file under --save remembers it)."""
    import os
    import signal

    marker = os.path.join(args.save, "trainer_killed_once")
    if rollout_id == 2 and not os.path.exists(marker):
        open(marker, "w").close()
        os.kill(os.getpid(), signal.SIGKILL)
