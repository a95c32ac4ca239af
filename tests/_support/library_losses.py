"""The real libraries' loss classes for the integration tests, loaded from their installed
files without running their packages' ``__init__`` (open_clip and lightly import torchvision
there, which cannot be installed beside CI's pinned CPU torch).  ``None`` where the library is
not installed (the tests then skip, saying so)."""
import importlib
import importlib.util
import sys
import types
from typing import Optional


def _package_dir(name: str) -> Optional[str]:
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        return None
    return list(spec.submodule_search_locations)[0]


def open_clip_loss():
    """``open_clip/loss.py`` as a module (it imports torch only)."""
    root = _package_dir("open_clip")
    if root is None:
        return None
    spec = importlib.util.spec_from_file_location("_open_clip_loss", f"{root}/loss.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def lightly_ntxent():
    """lightly's ``NTXentLoss`` class: its packages stand in as empty namespaces over the
    installed folders, so that only the modules the loss imports run."""
    root = _package_dir("lightly")
    if root is None:
        return None
    for name in ("lightly", "lightly.models", "lightly.models.modules", "lightly.utils",
                 "lightly.loss"):
        m = types.ModuleType(name)
        m.__path__ = [root + name[len("lightly"):].replace(".", "/")]
        m._cupynce_stub = 1
        sys.modules[name] = m
    # lightly.models.utils imports torchvision; the memory bank uses only its
    # concat_all_gather, and only for a non-zero bank, which these tests never build
    utils = types.ModuleType("lightly.models.utils")
    utils.concat_all_gather = None
    sys.modules["lightly.models.utils"] = utils
    cls = importlib.import_module("lightly.loss.ntx_ent_loss").NTXentLoss
    # the stubs out again (the class keeps what it imported); a snapshot of sys.modules, read
    # through __dict__: a lazy module's __getattr__ may import, changing sys.modules mid-loop
    for name, mod in list(sys.modules.items()):
        if name == "lightly.models.utils" or getattr(mod, "__dict__", {}).get("_cupynce_stub"):
            del sys.modules[name]
    return cls
