"""Real SGLang at scale: engine layout (``--sglang-config`` YAML or flags), launch plans (one command
line per engine process), server and router launch, and engines launched elsewhere."""
