"""``parser_cases.parse_all()`` with SGLang's own parsers importable; prints JSON (run in a subprocess)."""

import json

from tests.backends.sglang_utils.sglang_env import prepare_imports

if __name__ == "__main__":
    prepare_imports()
    from slime.agent.parsing import sglang_available
    from tests.agent.parser_cases import parse_all

    print(json.dumps({"sglang_available": sglang_available(), **parse_all()}))
