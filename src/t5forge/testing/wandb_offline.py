"""What a W&B run logged offline, read back for tests from its RUN_DIR/wandb/offline-run-*/run-ID.wandb files,
without wandb-core or a network. W&B dropped its own Python reader of these files (the internal DataStore,
gone in 0.31), so the format is read here: a 7-byte header (":W&B", 0xBEE1, version 0), then 32 KiB
blocks of chunks [crc32 u32 | length u16 | type u8 | data] in LevelDB's log format (types FULL, FIRST,
MIDDLE, LAST), each whole payload a wandb_internal_pb2.Record. A tail torn by a crash is ignored.
"""
from __future__ import annotations

import glob
import json
import os
import struct
import zlib
from typing import Any, Iterator

from wandb.proto import wandb_internal_pb2 as pb

_HDR = 7
_BLOCK = 32768
_FULL, _FIRST, _MIDDLE, _LAST = 1, 2, 3, 4
_CRC_SEED = {t: zlib.crc32(bytes([t])) & 0xFFFFFFFF for t in (1, 2, 3, 4)}


def iter_records(path: str, verify_crc: bool = True) -> Iterator[pb.Record]:
    """Yield every Record in a .wandb file. A truncated tail (crashed writer) is ignored."""
    with open(path, "rb") as f:
        buf = f.read()
    ident, magic, version = struct.unpack("<4sHB", buf[:_HDR])
    if ident != b":W&B" or magic != 0xBEE1 or version != 0:
        raise ValueError(f"{path}: not a W&B transaction log ({ident!r} {magic:#x} v{version})")
    pos, n, pending = _HDR, len(buf), None
    while pos < n:
        left = _BLOCK - pos % _BLOCK
        if left < _HDR:            # block trailer padding (zeros)
            pos += left
            continue
        if pos + _HDR > n:
            break
        crc, length, typ = struct.unpack_from("<IHB", buf, pos)
        data = buf[pos + _HDR: pos + _HDR + length]
        if typ == 0 and length == 0:   # zero padding
            pos += left
            continue
        if len(data) < length:
            break                       # truncated write
        if verify_crc and zlib.crc32(data, _CRC_SEED.get(typ, 0)) & 0xFFFFFFFF != crc:
            raise ValueError(f"{path}: bad checksum at offset {pos}")
        pos += _HDR + length
        if typ == _FULL:
            pending = None
            payload = data
        elif typ == _FIRST:
            pending = bytearray(data)
            continue
        elif typ == _MIDDLE and pending is not None:
            pending += data
            continue
        elif typ == _LAST and pending is not None:
            payload, pending = bytes(pending + data), None
        else:
            raise ValueError(f"{path}: unexpected chunk type {typ} at offset {pos}")
        rec = pb.Record()
        rec.ParseFromString(payload)
        yield rec


def _key(item) -> str:
    return "/".join(item.nested_key) if item.nested_key else item.key


def _hist_value(item) -> Any:
    """value_json (default 'json' encoding) or the typed oneof (x_history_value_encoding='typed')."""
    if item.value_json:
        return json.loads(item.value_json)
    which = item.WhichOneof("value")
    if which in (None, "none"):
        return None
    v = getattr(item, which)
    return json.loads(v) if which == "json" else v


def read_offline_run(run_dir_or_wandb_file: str) -> dict:
    """Parse one offline run dir (…/offline-run-*-ID) or one .wandb file.

    Returns {"run_id", "project", "name", "config", "summary",
             "history": [(step, key, value), ...]}  (internal keys like _runtime/_timestamp dropped).
    """
    p = run_dir_or_wandb_file
    files = [p] if p.endswith(".wandb") else sorted(glob.glob(os.path.join(p, "run-*.wandb")))
    if not files:
        raise FileNotFoundError(f"no run-*.wandb under {p}")
    out = {"run_id": None, "project": None, "name": None, "config": {}, "summary": {}, "history": []}

    def apply_config(cr):
        for it in cr.update:
            if it.key == "_wandb" or (it.nested_key and it.nested_key[0] == "_wandb"):
                continue
            val = json.loads(it.value_json)
            if it.nested_key:       # nested update: walk/create dicts
                d = out["config"]
                for k in it.nested_key[:-1]:
                    d = d.setdefault(k, {})
                d[it.nested_key[-1]] = val
            else:
                out["config"][it.key] = val
        for it in cr.remove:
            out["config"].pop(it.key, None)

    for path in files:
        for rec in iter_records(path):
            kind = rec.WhichOneof("record_type")
            if kind == "run":
                r = rec.run
                out["run_id"], out["project"] = r.run_id, r.project
                out["name"] = r.display_name or out["name"]
                apply_config(r.config)
            elif kind == "config":
                apply_config(rec.config)
            elif kind == "history":
                items = {_key(i): i for i in rec.history.item}
                step = rec.history.step.num if rec.history.HasField("step") else None
                if "_step" in items:
                    step = int(_hist_value(items["_step"]))
                for k, i in items.items():
                    if not k.startswith("_"):
                        out["history"].append((step, k, _hist_value(i)))
            elif kind == "summary":
                for it in rec.summary.update:
                    k = _key(it)
                    if not k.startswith("_"):
                        out["summary"][k] = json.loads(it.value_json)
                for it in rec.summary.remove:
                    out["summary"].pop(_key(it), None)
    return out


def read_offline_runs(wandb_dir: str, run_id: str) -> dict:
    """Merge every run dir of <run_id> under <dir>/wandb, in chronological order.

    Each offline process (first run and every resume) gets a NEW dir
    offline-run-<YYYYmmdd_HHMMSS>-<id>, or ...-<id>-<N> if two start in the same second.
    """
    root = wandb_dir if os.path.basename(wandb_dir) == "wandb" else os.path.join(wandb_dir, "wandb")
    files = glob.glob(os.path.join(root, "*run-*", f"run-{run_id}.wandb"))

    def order(f):
        name = os.path.basename(os.path.dirname(f))          # offline-run-TS-ID[-N]
        tail = name.split("-run-", 1)[-1] if "-run-" in name else name[len("run-"):]
        ts, rest = tail[:15], tail[16:]
        n = int(rest[len(run_id) + 1:]) if rest != run_id and rest[len(run_id) + 1:].isdigit() else 0
        return (ts, n)

    dirs = [os.path.dirname(f) for f in sorted(files, key=order)]
    merged = {"run_id": run_id, "project": None, "name": None, "config": {}, "summary": {}, "history": [], "dirs": dirs}
    for d in dirs:
        r = read_offline_run(d)
        merged["project"] = r["project"] or merged["project"]
        merged["name"] = r["name"] or merged["name"]
        merged["config"].update(r["config"])
        merged["summary"].update(r["summary"])
        merged["history"].extend(r["history"])
    return merged
