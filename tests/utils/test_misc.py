import pytest

from slime.utils.misc import SingletonMeta, load_function


def test_load_function_success():
    assert load_function("slime.utils.types.Sample").__name__ == "Sample"
    assert load_function("os.path:join")("a", "b") == "a/b"


def test_load_function_missing_module():
    with pytest.raises(ImportError) as e:
        load_function("no_such_pkg.module.fn")
    assert "'no_such_pkg.module.fn'" in str(e.value) and "'no_such_pkg.module'" in str(e.value)


def test_load_function_missing_attribute():
    with pytest.raises(AttributeError) as e:
        load_function("slime.utils.misc.no_such_function")
    message = str(e.value)
    assert "'slime.utils.misc'" in message and "'no_such_function'" in message and "load_function" in message


@pytest.mark.parametrize("path", ["", "nodots", None])
def test_load_function_malformed(path):
    with pytest.raises(ValueError, match="dotted path"):
        load_function(path)


def test_singleton_meta():
    class Thing(metaclass=SingletonMeta):
        def __init__(self):
            self.value = object()

    assert Thing() is Thing()
    first = Thing()
    SingletonMeta.clear_instances()
    assert Thing() is not first
