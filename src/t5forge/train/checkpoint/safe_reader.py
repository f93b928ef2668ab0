"""Reading DCP checkpoints without running code. DCP's FileSystemReader unpickles `.metadata` with plain
pickle.load: a crafted checkpoint would run any code it holds. Ours admits only the classes DCP's metadata is
made of (checked on the torch versions we support); anything else stops the load before it is built.
Hand-written because DCP has no safe reader of its own."""

from __future__ import annotations

import os
import pickle
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, StorageMeta

from t5forge.errors import CheckpointError

_METADATA_CLASSES = {
    "torch.distributed.checkpoint.metadata": {
        "Metadata", "TensorStorageMetadata", "TensorProperties", "ChunkStorageMetadata", "MetadataIndex",
        "StorageMeta", "BytesStorageMetadata", "_MEM_FORMAT_ENCODING"},
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},
    "torch": {"Size"},
    "pathlib": {"PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath"},
    "collections": {"OrderedDict"},
}


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if name in _METADATA_CLASSES.get(module, ()) or (module == "torch" and isinstance(getattr(torch, name, None),
                                                                                          torch.dtype)):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"it asks for {module}.{name}, which is not part of DCP's metadata "
                                     "(refused: unpickling it could run code)")


class SafeFileSystemReader(FileSystemReader):
    """FileSystemReader whose `.metadata` goes through _MetadataUnpickler, and which refuses entries stored
    as pickled bytes (t5forge stores tensors only; DCP would torch.load such entries with weights_only=False)."""

    def read_metadata(self, *args, **kwargs) -> Metadata:
        path = Path(self.path) / ".metadata"
        try:
            with open(path, "rb") as f:
                metadata = _MetadataUnpickler(f).load()
        except Exception as e:  # a damaged pickle fails with many types
            raise CheckpointError(f"{path} is corrupt or not DCP metadata ({last_line(e)}); use another "
                                  "checkpoint") from e
        if not isinstance(metadata, Metadata):
            raise CheckpointError(f"{path} holds a {type(metadata).__name__}, not DCP metadata; use another checkpoint")
        pickled = sorted(k for k, v in metadata.state_dict_metadata.items() if isinstance(v, BytesStorageMetadata))
        if pickled:
            raise CheckpointError(f"{path} declares pickled entries ({', '.join(pickled[:3])}), which t5forge never "
                                  "writes and will not unpickle; use a checkpoint written by t5forge")
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


def read_metadata(path: str | os.PathLike) -> Metadata:
    return SafeFileSystemReader(path).read_metadata()


def dcp_load(state: dict, path: Path) -> None:
    """Fill the tensors of `state` in place from checkpoint `path` (any layout: DCP reshards)."""
    try:
        dcp.load(state, storage_reader=SafeFileSystemReader(path))
    except CheckpointError:
        raise
    except Exception as e:  # DCP's read errors have no common type
        raise CheckpointError(f"cannot read the tensors of {path}: {last_line(e)}; the checkpoint is incomplete "
                              "or corrupt") from e


def is_dcp_checkpoint(path: str | os.PathLike) -> bool:
    return (Path(path) / ".metadata").is_file()


def check_checkpoint_files(path: str | os.PathLike) -> None:
    """Every data file the DCP metadata refers to exists and is long enough; else name the file."""
    path = Path(path)
    needed: dict[str, int] = {}
    for info in (read_metadata(path).storage_data or {}).values():
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    for name, size in sorted(needed.items()):
        file = path / name
        if not file.is_file():
            raise CheckpointError(f"checkpoint file {file} is missing; use another checkpoint")
        if file.stat().st_size < size:
            raise CheckpointError(f"checkpoint file {file} is truncated ({file.stat().st_size} of {size} bytes); "
                                  "use another checkpoint")


def last_line(error: BaseException) -> str:
    """The last non-empty line of an error's message (DCP's wrap every rank's traceback)."""
    lines = [line for line in str(error).splitlines() if line.strip()]
    return lines[-1].strip() if lines else type(error).__name__
