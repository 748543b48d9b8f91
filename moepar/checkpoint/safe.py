"""Reading a checkpoint without running code (docs/faults.md, "What a checkpoint may contain").

A pickle names callables that unpickling calls, so a crafted one runs whatever it names.
Three readers here, none of which calls anything but data constructors:

* ``.metadata`` (DCP's index of the shards, a pickle): a restricted unpickler admits only
  the classes DCP's metadata is made of (``METADATA_CLASSES``, read from torch's
  ``torch/distributed/checkpoint/metadata.py`` and ``filesystem.py``); any other name is a
  ``CheckpointError`` naming the file and the class, before any other file is read. DCP
  then reads the very bytes that passed (``checked_reader``), never the file again.
* moepar's own entries (param groups, extras, RNG streams, counters): written as
  ``torch.save`` of plain data (``check_plain``), read with ``torch.load(weights_only=True)``,
  which admits tensors and plain values only. The shard slices are read here directly
  (``read_entry``), so every entry is decoded, and every refusal raised, before DCP loads
  anything; ``SafeLoadPlanner`` makes DCP's own reading of such entries weights-only too.
* Entries written by moepar before this format (plain ``pickle.dumps``): a restricted
  unpickler that admits plain values, tensors, NumPy arrays and moepar's slot maps;
  anything else only with ``trust_pickles=True``.

Tensors themselves DCP reads with ``torch.load(weights_only=True)`` by itself.
"""
from __future__ import annotations

import collections
import contextlib
import io
import os
import pickle

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import FileSystem


class CheckpointError(ValueError):
    """A checkpoint that cannot be written or loaded as asked, raised before anything is
    written or loaded, on every rank alike; the message names the file (or entry) and what
    is wrong with it."""


# Plain data: what ``torch.load(weights_only=True)`` reads back without running code.
_SCALARS = (bool, int, float, str, bytes, type(None))
_TORCH_VALUES = (torch.Size, torch.dtype, torch.device)
_RULE = ("a checkpoint holds tensors, numbers, strings, bools, None and lists, tuples and dicts of "
         "them, so that loading it runs no code (docs/faults.md, \"What a checkpoint may contain\")")


def _type_name(value) -> str:
    t = type(value)
    return t.__qualname__ if t.__module__ == "builtins" else f"{t.__module__}.{t.__qualname__}"


def check_plain(value, where: str) -> None:
    """CheckpointError naming ``where`` (and the path inside it) and the type, unless
    ``value`` is plain data. Exact types: a subclass (an IntEnum, a NumPy float, a
    DTensor) could carry code into the file."""
    t = type(value)
    if t in _SCALARS or t in _TORCH_VALUES or t in (torch.Tensor, torch.nn.Parameter):
        return
    if t in (list, tuple):
        for i, v in enumerate(value):
            check_plain(v, f"{where}[{i}]")
        return
    if t in (dict, collections.OrderedDict):
        for k, v in value.items():
            if type(k) not in _SCALARS:
                raise CheckpointError(f"{where} has a key of type {_type_name(k)} ({k!r}): {_RULE}")
            check_plain(v, f"{where}[{k!r}]")
        return
    raise CheckpointError(f"{where} is a {_type_name(value)}, not plain data: {_RULE}; convert it "
                          f"(e.g. float(x), x.tolist(), dataclasses.asdict(x))")


def pack(value, where: str) -> bytes:
    """``value`` (checked plain) as opaque bytes, ``torch.save``'s zip: DCP would otherwise
    flatten nested dicts and lists into many keys."""
    check_plain(value, where)
    buf = io.BytesIO()
    torch.save(value, buf)
    return buf.getvalue()


def _weights_only(data: bytes, where: str):
    """``torch.load(weights_only=True)`` of ``data``; a refusal names what it refused."""
    try:
        return torch.load(io.BytesIO(data), weights_only=True, map_location="cpu")
    except pickle.UnpicklingError as e:
        try:
            names = torch.serialization.get_unsafe_globals_in_checkpoint(io.BytesIO(data))
        except Exception:   # not a zip file: the loader's own words
            names = []
        what = f"it names {', '.join(names)}" if names else f"{str(e).splitlines()[0]}"
        raise CheckpointError(f"{where}: refused ({what}): {_RULE}") from None
    except Exception as e:
        raise CheckpointError(f"{where}: unreadable ({type(e).__name__}: {e})") from None


def unpack(blob, where: str, trust_pickles: bool = False):
    """The value of an entry read back: moepar's packed bytes (``torch.save``'s zip, read
    weights-only), an entry of an earlier moepar (a pickle, through ``_LegacyUnpickler``
    unless ``trust_pickles``), or a value DCP stored as it was."""
    if not isinstance(blob, bytes):
        return blob
    if blob[:2] == b"PK":
        return _weights_only(blob, where)
    if trust_pickles:
        return pickle.loads(blob)
    try:
        return _LegacyUnpickler(io.BytesIO(blob), where).load()
    except CheckpointError:
        raise
    except Exception as e:
        raise CheckpointError(f"{where}: unreadable ({type(e).__name__}: {e})") from None


def _torch_dtypes() -> dict:
    return {name: v for name, v in vars(torch).items() if isinstance(v, torch.dtype)}


def _load_storage_weights_only(data: bytes):
    """``torch.storage._load_from_bytes`` (how a plain pickle of a tensor holds its storage),
    reading weights-only where torch's own reads everything."""
    return torch.load(io.BytesIO(data), weights_only=True)


def _legacy_classes() -> dict:
    from ..moe.replication import placement
    allowed = {("collections", "OrderedDict"): collections.OrderedDict,
               ("torch._utils", "_rebuild_tensor_v2"): torch._utils._rebuild_tensor_v2,
               ("torch.storage", "_load_from_bytes"): _load_storage_weights_only,
               ("torch", "Size"): torch.Size,
               # the earlier format pickled the slot maps under their module of the time
               **{(module, cls): getattr(placement, cls) for module in (
                   "moepar.moe.placement", "moepar.moe.replication.placement") for cls in ("Placement", "Copy")}}
    allowed.update({("torch", name): v for name, v in _torch_dtypes().items()})
    try:   # NumPy's generator state (an array): data constructors only; an object array's
        import numpy   # elements are unpickled through find_class like everything else
        multiarray = numpy._core.multiarray if hasattr(numpy, "_core") else numpy.core.multiarray
        for module in ("numpy.core.multiarray", "numpy._core.multiarray"):   # NumPy 1 and 2 names
            allowed[(module, "_reconstruct")] = multiarray._reconstruct
            allowed[(module, "scalar")] = multiarray.scalar
        allowed[("numpy", "ndarray")] = numpy.ndarray
        allowed[("numpy", "dtype")] = numpy.dtype
    except ImportError:
        pass
    return allowed


class _AllowList(pickle.Unpickler):
    """Unpickles the (module, name) pairs of ``allowed`` alone: any other class, and any
    persistent id, raises a CheckpointError naming ``where``; the subclasses say why."""
    refused = "{module}.{name}"   # the message's text after "<where>: "
    persistent = "a pickle with persistent ids"

    def __init__(self, file, where: str, allowed: dict):
        super().__init__(file)
        self.where, self.allowed = where, allowed

    def find_class(self, module: str, name: str):
        found = self.allowed.get((module, name))
        if found is None:
            raise CheckpointError(f"{self.where}: " + self.refused.format(module=module, name=name))
        return found

    def persistent_load(self, pid):
        raise CheckpointError(f"{self.where}: {self.persistent}")


class _LegacyUnpickler(_AllowList):
    """An entry written by moepar before this format, admitting data constructors only."""
    refused = ("written by an earlier moepar as a pickle that names {module}.{name}, which loading would call "
               "(it could run any code). If you trust where this checkpoint came from, load it with "
               "trust_pickles=True (docs/faults.md, \"What a checkpoint may contain\")")
    persistent = "a pickle with persistent ids, not written by moepar"

    def __init__(self, file, where: str):
        super().__init__(file, where, _legacy_classes())


def _metadata_classes() -> dict:
    from pathlib import Path, PosixPath, PurePosixPath, PureWindowsPath, WindowsPath

    from torch.distributed.checkpoint import filesystem, metadata
    allowed = {("torch.distributed.checkpoint.metadata", name): getattr(metadata, name) for name in (
        "Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata",
        "TensorProperties", "_MEM_FORMAT_ENCODING", "StorageMeta", "MetadataIndex")}
    allowed.update({("torch.distributed.checkpoint.filesystem", name): getattr(filesystem, name)
                    for name in ("_StorageInfo", "_StoragePrefix")})
    allowed.update({("pathlib", c.__name__): c for c in (Path, PosixPath, PurePosixPath, PureWindowsPath, WindowsPath)})
    allowed.update({("torch", "Size"): torch.Size, ("collections", "OrderedDict"): collections.OrderedDict,
                    ("torch.serialization", "_get_layout"): torch.serialization._get_layout})
    allowed.update({("torch", name): v for name, v in _torch_dtypes().items()})
    return allowed


class _MetadataUnpickler(_AllowList):
    refused = ("refused: it names {module}.{name}, which is not one of the classes torch.distributed.checkpoint's "
               "metadata is made of (unpickling it could run any code); a crafted or foreign file, nothing was loaded")
    persistent = "refused: a pickle with persistent ids is not DCP metadata"

    def __init__(self, file, where: str):
        super().__init__(file, where, _metadata_classes())


class _ServedMetadata(FileSystem):
    """DCP's file system, except that ``.metadata`` is the bytes already checked: DCP then
    unpickles exactly what passed ``_MetadataUnpickler``, never the file a second time."""

    def __init__(self, data: bytes):
        super().__init__()
        self.data = data

    @contextlib.contextmanager
    def create_stream(self, path, mode: str):
        if os.path.basename(str(path)) == ".metadata" and "r" in mode:
            yield io.BytesIO(self.data)
        else:
            with super().create_stream(path, mode) as stream:
                yield stream


def checked_reader(path: str):
    """(DCP's ``FileSystemReader`` for ``path`` serving the checked ``.metadata``, the
    metadata). CheckpointError, naming the file, when ``.metadata`` is missing, unreadable,
    names a class DCP's metadata is not made of, or points outside ``path``."""
    from torch.distributed.checkpoint.metadata import Metadata
    meta_file = os.path.join(path, ".metadata")
    if not os.path.isfile(meta_file):
        raise CheckpointError(f"{meta_file}: missing, so {path} is not a complete checkpoint "
                              f"(a save that never finished, or not a checkpoint directory)")
    with open(meta_file, "rb") as f:
        data = f.read()
    try:
        checked = _MetadataUnpickler(io.BytesIO(data), meta_file).load()
    except CheckpointError:
        raise
    except Exception as e:
        raise CheckpointError(f"{meta_file}: unreadable ({type(e).__name__}: {e}); truncated, "
                              f"or not written by torch.distributed.checkpoint") from None
    if not isinstance(checked, Metadata):
        raise CheckpointError(f"{meta_file}: holds a {_type_name(checked)}, not DCP's Metadata")
    reader = dcp.FileSystemReader(path)
    reader.fs = _ServedMetadata(data)
    md = reader.read_metadata()
    if not isinstance(md.state_dict_metadata, dict) or not isinstance(md.storage_data, dict):
        raise CheckpointError(f"{meta_file}: not DCP's metadata (no entry or storage tables)")
    for info in md.storage_data.values():
        name = getattr(info, "relative_path", None)
        if not isinstance(name, str) or os.path.basename(name) != name or name in ("", ".", ".."):
            raise CheckpointError(f"{meta_file}: a shard named {name!r}, outside {path}: refused")
        if not (type(info.offset) is int and type(info.length) is int and info.offset >= 0 and info.length >= 0):
            raise CheckpointError(f"{meta_file}: shard {name} has offset {info.offset!r}, length {info.length!r}")
    return reader, md


def read_entry(path: str, md, key: str, trust_pickles: bool = False):
    """The value of non-tensor entry ``key``, read from its shard's slice directly (no
    collective: each rank reads what it needs) and decoded without running code."""
    from torch.distributed.checkpoint.metadata import MetadataIndex
    info = md.storage_data.get(MetadataIndex(key))
    if info is None:
        raise CheckpointError(f"{os.path.join(path, '.metadata')}: entry {key} has no storage record")
    shard = os.path.join(path, info.relative_path)
    if getattr(info, "transform_descriptors", None):
        raise CheckpointError(f"{shard}: entry {key} is stored through transforms "
                              f"{list(info.transform_descriptors)}, which moepar does not write")
    with open(shard, "rb") as f:
        f.seek(info.offset)
        data = f.read(info.length)
    where = f"{shard}: entry {key}"
    return unpack(_weights_only(data, where), where, trust_pickles)


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's default planner, whose non-tensor entries are read weights-only (torch's reads
    them with ``weights_only=False``)."""

    def load_bytes(self, read_item, value) -> None:
        from torch.distributed.checkpoint._traverse import set_element
        key = read_item.dest_index.fqn
        obj = _weights_only(value.read(), f"entry {key}")
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[key], obj)
        else:
            self.state_dict[key] = obj
