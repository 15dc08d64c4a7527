"""The HTTP side of the engine: SGLang's native endpoints, the OpenAI-compatible API, the asyncio bridge
to the engine thread and the subprocess launcher."""
