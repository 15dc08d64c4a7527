"""The command line's public path (docs/INTERFACES.md: hooks receive ``slime.utils.arguments.parse_args()``'s
namespace): the same module as :mod:`slime.arguments`, which builds and validates it with the backends' flags."""

import sys

from slime import arguments as _arguments

if __name__ == "__main__":  # python -m slime.utils.arguments  -> prints the flag reference
    print(_arguments.flag_reference_markdown())
else:
    sys.modules[__name__] = _arguments
