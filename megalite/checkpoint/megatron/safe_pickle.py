"""Reading the pickles inside Megatron-LM checkpoints without running their code.

A pickle names globals (module.name) that the unpickler imports and may call: a crafted one can
name `os.system`. The pickles of Megatron-LM's formats (torch_dist's `.metadata` and `common.pt`,
the legacy `model_optim_rng.pt`) need only plain data, tensors, torch.distributed.checkpoint's
metadata classes and argparse's `Namespace`, so this unpickler resolves only those
(`ALLOWED`, plus torch's own weights-only allow-list), and turns every `megatron.*` global (the
enums and small classes of Megatron-LM's `args`) into an inert `Opaque` record that never imports
or runs anything. Any other global is refused with one line naming the file.

torch.load goes through it by `pickle_module` (torch's zip reader adds its storage handling on top).
"""
from __future__ import annotations

import argparse
import io
import pickle
import sys

import torch

from ...errors import CheckpointError

# module -> names resolved to the real object (plain classes, data only, no callables that act)
ALLOWED = {
    "collections": {"OrderedDict", "defaultdict"},
    "argparse": {"Namespace"},
    "builtins": {"set", "frozenset", "list", "dict", "tuple", "slice", "int", "float", "complex", "bool", "str",
                 "bytes", "bytearray", "range", "object"},
    "copyreg": {"_reconstructor"},
    "pathlib": {"PosixPath", "PurePosixPath"},
    "torch": {"Size", "device", "dtype", "float32", "float16", "bfloat16", "float64", "int64", "int32", "int16",
              "int8", "uint8", "bool", "strided", "contiguous_format", "channels_last", "preserve_format"},
    "torch._utils": {"_rebuild_tensor_v2", "_rebuild_parameter", "_rebuild_tensor", "_rebuild_parameter_with_state"},
    "torch.distributed.checkpoint.metadata": {"Metadata", "TensorStorageMetadata", "BytesStorageMetadata",
                                              "ChunkStorageMetadata", "TensorProperties", "MetadataIndex",
                                              "StorageMeta", "_MEM_FORMAT_ENCODING"},
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.distributed.checkpoint.planner": {"WriteItemType", "LoadItemType", "SavePlan", "WriteItem",
                                             "TensorWriteData", "BytesIOWriteData"},
    "torch.serialization": {"_get_layout"},
    "numpy": {"dtype", "ndarray"},
    "numpy.core.multiarray": {"_reconstruct", "scalar"},
    "numpy._core.multiarray": {"_reconstruct", "scalar"},
    "numpy.dtypes": {"Float64DType", "Float32DType", "Int64DType", "Int32DType"},
}
INERT_PREFIXES = ("megatron.",)  # recorded by name, never imported


class UnsafePickle(CheckpointError):
    """A pickle names a global outside the allow-list."""


class Opaque:
    """A Megatron-LM object recorded without importing its class: its name, the arguments it was
    built with and its state (an enum's value is `args[0]`)."""
    qualname = "?"

    def __new__(cls, *args, **kwargs):
        self = object.__new__(cls)
        self.args, self.state = args, None
        return self

    def __init__(self, *args, **kwargs):
        pass

    def __setstate__(self, state):
        self.state = state

    def __repr__(self):
        return f"<{self.qualname}{self.args!r}>"


_opaque_classes: dict[str, type] = {}


def _opaque(module: str, name: str) -> type:
    qualname = f"{module}.{name}"
    if qualname not in _opaque_classes:
        _opaque_classes[qualname] = type(name, (Opaque,), {"qualname": qualname})
    return _opaque_classes[qualname]


def _torch_allowed() -> dict:
    """torch's own weights-only allow-list (tensor rebuilds, storages), where this torch has it."""
    try:
        from torch._weights_only_unpickler import _get_allowed_globals
        return dict(_get_allowed_globals())
    except (ImportError, AttributeError):
        return {}


class Unpickler(pickle.Unpickler):
    """pickle.Unpickler resolving only the allow-listed globals (see the module docstring)."""
    source = "<bytes>"

    def find_class(self, module: str, name: str):
        if name in ALLOWED.get(module, ()):
            __import__(module)
            return getattr(sys.modules[module], name)
        torch_ok = _torch_allowed().get(f"{module}.{name}")
        if torch_ok is not None:
            return torch_ok
        if module.startswith(INERT_PREFIXES):
            return _opaque(module, name)
        raise UnsafePickle(f"{self.source}: refusing to unpickle {module}.{name}, which is not on the allow-list "
                           "of a checkpoint's plain data (the file may be crafted to run code)")


def _unpickler_for(source: str) -> type:
    return type("Unpickler", (Unpickler,), {"source": source})


class _PickleModule:
    """What torch.load's `pickle_module` needs: an Unpickler class and load()."""

    def __init__(self, source: str):
        self.Unpickler = _unpickler_for(source)
        self.__name__ = "megalite.checkpoint.megatron.safe_pickle"

    def load(self, f, **kwargs):
        return self.Unpickler(f, **kwargs).load()


def load_pickle(path: str):
    """A plain pickle file (torch_dist's `.metadata`), through the allow-list."""
    try:
        with open(path, "rb") as f:
            return _unpickler_for(path)(f).load()
    except UnsafePickle:
        raise
    except (OSError, EOFError, pickle.UnpicklingError, AttributeError, TypeError, ValueError) as e:
        raise CheckpointError(f"{path}: cannot read it ({type(e).__name__}: {e})") from None


def torch_load(source, name: str | None = None, mmap: bool = False):
    """torch.load of a file path or bytes (`name` names it in errors) through the allow-list."""
    label = name or (source if isinstance(source, str) else "<bytes>")
    f = io.BytesIO(source) if isinstance(source, (bytes, bytearray, memoryview)) else source
    try:
        return torch.load(f, map_location="cpu", weights_only=False, pickle_module=_PickleModule(label),
                          mmap=mmap and isinstance(source, str))
    except UnsafePickle:
        raise
    except (OSError, EOFError, RuntimeError, pickle.UnpicklingError, AttributeError, TypeError, ValueError) as e:
        raise CheckpointError(f"{label}: cannot read it ({type(e).__name__}: {e})") from None


def namespace_dict(args) -> dict:
    """Megatron-LM's `args` (a Namespace) as a dict, inert records as their enum value or name."""
    items = vars(args) if isinstance(args, argparse.Namespace) else dict(args or {})
    out = {}
    for k, v in items.items():
        if isinstance(v, Opaque):
            v = v.args[0] if len(v.args) == 1 else v.qualname
        out[k] = v
    return out

