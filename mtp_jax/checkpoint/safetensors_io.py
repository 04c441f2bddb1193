"""Safetensors files, read and written here directly (header + raw bytes, bf16 and fp8
through ml_dtypes), so a truncated or corrupt file is caught with a clear message, and the
HF folder's file set (one file, or shards with their index).

`read_safetensors_header` checks every entry against the file size before any data is
read; `read_tensor` memory-maps one tensor; `write_safetensors` writes one file;
`hf_files` lists a folder's safetensors files with its index's weight map.
`CheckpointError` is the error of every checkpoint module; `problems_error` makes one that
names the first few of a long list of tensors (all of them in its `full`).
"""

from __future__ import annotations

import json
import os
import struct
from typing import Optional

import ml_dtypes
import numpy as np


SHOWN = 5  # items of a list named in an error message; the rest are counted


class CheckpointError(ValueError):
    """A checkpoint that does not match its config or is unreadable. `full`: the message
    with every item of its lists, where the message names the first few and a count (a
    truncated checkpoint fails on every tensor: one line of them all does not read)."""

    def __init__(self, message: str, full: Optional[str] = None):
        super().__init__(message)
        self.full = full or message


def listed(items, shown: Optional[int] = SHOWN, sep: Optional[str] = None) -> str:
    """`items` as a list (joined by `sep`, else as Python's list repr): the first `shown`
    and a count of the rest, all of them when `shown` is None."""
    items = list(items)
    cut = items if shown is None or len(items) <= shown else items[:shown]
    more = f"... and {len(items) - len(cut)} more ({len(items)} in all)" \
        if len(cut) < len(items) else ""
    if sep is not None:
        return sep.join(cut + ([more] if more else []))
    return repr(cut)[:-1] + (f", {more}]" if more else "]")


def problems_error(prefix: str, problems: list, sep: str) -> CheckpointError:
    """CheckpointError of `prefix` + `problems` joined by `sep`: each a string, or a
    function of `shown` (`listed`'s) for one that names a list of tensors. The message
    shows the first SHOWN of every list (and of the problems), `full` all of them."""
    def text(shown):
        parts = [p if isinstance(p, str) else p(shown) for p in problems]
        return prefix + listed(parts, shown, sep)
    return CheckpointError(text(SHOWN), full=text(None))


_ST_DTYPES = {"F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
              "F64": np.float64, "I64": np.int64, "I32": np.int32, "I16": np.int16,
              "I8": np.int8, "U8": np.uint8, "BOOL": np.bool_,
              "F8_E4M3": ml_dtypes.float8_e4m3fn, "F8_E5M2": ml_dtypes.float8_e5m2}
FLOAT_CODES = {"F32", "F16", "BF16", "F64"}
FP8_CODES = {"F8_E4M3", "F8_E5M2"}
_NP_TO_ST = {np.dtype(v): k for k, v in _ST_DTYPES.items()}


def read_safetensors_header(path: str) -> dict:
    """{name: (dtype_code, shape, (begin, end))} with offsets checked against the file size."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise CheckpointError(f"{path}: truncated safetensors file (no header)")
        (n,) = struct.unpack("<Q", head)
        if n > size - 8 or n > 100 * 2**20:
            raise CheckpointError(f"{path}: truncated or corrupt safetensors header "
                                  f"(header length {n}, file size {size})")
        try:
            header = json.loads(f.read(n))
        except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as e:
            raise CheckpointError(f"{path}: corrupt safetensors header: "
                                  f"{type(e).__name__}: {str(e)[:200]}") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: corrupt safetensors header")
    out, problems = {}, []
    data_size = size - 8 - n
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            code, shape, (b, e) = info["dtype"], tuple(info["shape"]), info["data_offsets"]
        except (KeyError, TypeError, ValueError):
            problems.append(f"{name}: malformed header entry")
            continue
        ints = all(isinstance(x, int) and not isinstance(x, bool) and x >= 0
                   for x in shape + (b, e))
        if not ints:
            problems.append(f"{name}: shape and data offsets must be non-negative integers")
            continue
        if not isinstance(code, str) or code not in _ST_DTYPES:
            problems.append(f"{name}: unsupported dtype {code!r}")
            continue
        nbytes = np.dtype(_ST_DTYPES[code]).itemsize
        for x in shape:  # Python ints: no overflow however large the header claims
            nbytes *= x
        if e - b != nbytes or b < 0:
            problems.append(f"{name}: data offsets {b}..{e} do not match shape {shape} {code}")
        elif e > data_size:
            problems.append(f"{name}: data ends at byte {e} but the file holds {data_size} "
                            "(truncated file)")
        out[name] = (code, shape, (b, e))
    spans = sorted((b, e, name) for name, (_, _, (b, e)) in out.items())
    end, last = 0, None
    for b, e, name in spans:
        if b < end:
            problems.append(f"{name} and {last}: data bytes overlap ({b}..{e})")
        elif b > end:
            problems.append(f"{name}: a gap of {b - end} bytes before its data")
        if e > end:
            end, last = e, name
    if problems:  # a truncated file: one for every tensor past the cut
        raise problems_error(f"{path}: ", problems, "; ")
    return out


def read_tensor(path: str, header_len_and_entry) -> np.ndarray:
    base, (code, shape, (b, e)) = header_len_and_entry
    mm = np.memmap(path, dtype=np.uint8, mode="r", offset=base + b, shape=(e - b,))
    return np.frombuffer(mm, dtype=_ST_DTYPES[code]).reshape(shape)


def write_safetensors(path: str, tensors: dict[str, np.ndarray], metadata=None) -> None:
    header, offset, blobs = {}, 0, []
    for name in sorted(tensors):
        arr = np.ascontiguousarray(tensors[name])
        code = _NP_TO_ST.get(arr.dtype)
        if code is None:
            raise CheckpointError(f"cannot write dtype {arr.dtype} for {name}")
        blob = arr.tobytes()
        header[name] = {"dtype": code, "shape": list(arr.shape),
                        "data_offsets": [offset, offset + len(blob)]}
        offset += len(blob)
        blobs.append(blob)
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * ((8 - len(raw) % 8) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for blob in blobs:
            f.write(blob)


def hf_files(path: str) -> tuple[list[str], Optional[dict]]:
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            try:
                weight_map = json.load(f)["weight_map"]
            except (json.JSONDecodeError, KeyError, TypeError, UnicodeDecodeError) as e:
                raise CheckpointError(f"{index}: unreadable index ({e})") from None
        if not isinstance(weight_map, dict) or not all(
                isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()):
            raise CheckpointError(f"{index}: weight_map must map tensor names to file names")
        files = sorted(set(weight_map.values()))
        missing = [x for x in files if not os.path.exists(os.path.join(path, x))]
        if missing:
            raise CheckpointError(f"{index} names shard files that do not exist: {missing}")
        return [os.path.join(path, x) for x in files], weight_map
    single = os.path.join(path, "model.safetensors")
    if os.path.exists(single):
        return [single], None
    found = sorted(x for x in os.listdir(path) if x.endswith(".safetensors"))
    if not found:
        raise CheckpointError(f"{path}: no model.safetensors or model.safetensors.index.json")
    raise CheckpointError(f"{path}: found {found} but no model.safetensors.index.json to "
                          "say how they form one checkpoint")

