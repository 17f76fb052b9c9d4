"""One loader for what a config names by path: a reward, a buffer filter, an environment, an engine launcher.

A path is `package.module:name` (also `package.module.name`), importable from the run's PYTHONPATH, or a Python
file and a name in it, `path/to/file.py:name` (relative to the working directory), as in
`reward.fn=./my_reward.py:score`. Every failure is a `LoadError` of one shape, naming the config key:

    reward.fn: cannot import 'x.y:z': no module named 'x'; give a dotted path module:function or a file path
    file.py:function
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

__all__ = ["LoadError", "load_object"]


class LoadError(ValueError):
    """A config path that does not name an importable object; the message says which key and how to fix it."""

    def __init__(self, key: str, spec: str, reason: str, *, what: str = "function", builtins: str = "") -> None:
        choices = f"a built-in ({builtins}), a dotted path" if builtins else "a dotted path"
        super().__init__(
            f"{key}: cannot import {spec!r}: {reason}; give {choices} module:{what} or a file path file.py:{what}"
        )


def load_object(spec: str, *, key: str, what: str = "function", builtins: str = "") -> object:
    """The object `spec` names (see the module docstring); `key` (reward.fn) and `what` (function, Class) word the
    error, `builtins` lists the names the caller resolves itself, for the error's hint."""

    def fail(reason: str) -> LoadError:
        return LoadError(key, spec, reason, what=what, builtins=builtins)

    if ":" in spec:
        module_name, _, attr = spec.rpartition(":")
    else:
        module_name, _, attr = spec.rpartition(".")
    if not module_name or not attr or not attr.isidentifier():
        raise fail("it is not of the form module:name") from None
    if module_name.endswith(".py") or "/" in module_name:
        module = _import_file(Path(module_name), fail)
    else:
        module = _import_module(module_name, fail)
    if not hasattr(module, attr):
        public = sorted(n for n, v in vars(module).items() if callable(v) and not n.startswith("_"))
        raise fail(f"{module_name!r} has no attribute {attr!r} (it has: {', '.join(public) or 'no public callables'})")
    return getattr(module, attr)


def _import_module(name: str, fail: Callable[[str], LoadError]) -> ModuleType:
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as exc:
        if exc.name is not None and (name == exc.name or name.startswith(exc.name + ".")):
            raise fail(f"no module named {exc.name!r} (check the spelling, and that it is on PYTHONPATH)") from None
        # The module exists but one of its own imports is missing: that is the user's dependency to install.
        raise fail(f"importing {name!r} failed: {exc}") from None
    except Exception as exc:  # noqa: BLE001 - any error of the user's module is reported as the reason
        raise fail(f"importing {name!r} raised {type(exc).__name__}: {exc}") from None


def _import_file(path: Path, fail: Callable[[str], LoadError]) -> ModuleType:
    if path.suffix != ".py":
        raise fail(f"{str(path)!r} is not a Python file (file.py)")
    if not path.is_file():
        raise fail(f"no file {str(path)!r} (relative paths start at {Path.cwd()})")
    resolved = path.resolve()
    # One module per file, named after its absolute path: loading it twice gives the same objects.
    name = f"hpcrl_user_{resolved.stem}_{hashlib.blake2b(str(resolved).encode(), digest_size=6).hexdigest()}"
    if name in sys.modules:
        return sys.modules[name]
    module_spec = importlib.util.spec_from_file_location(name, resolved)
    if module_spec is None or module_spec.loader is None:
        raise fail(f"{str(path)!r} cannot be loaded as a module")
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[name] = module
    try:
        module_spec.loader.exec_module(module)
    except Exception as exc:  # noqa: BLE001 - any error of the user's file is reported as the reason
        del sys.modules[name]
        raise fail(f"running {str(path)!r} raised {type(exc).__name__}: {exc}") from None
    return module
