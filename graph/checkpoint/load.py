"""Reading an official checkpoint: the safetensors headers checked against the layout
(`checkpoint.spec`), memory-mapped tensors (a checkpoint that does not match its `config.json`
fails at load time with the names of the offending tensors instead of producing wrong numbers
later), the vision tower's tensors (all or none), and the weights' fingerprint.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
from collections.abc import Collection, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from safetensors import safe_open

from dsv41.graph.checkpoint.fp8_tiles import (
    check_fp8_tiles,
    dequantize_fp8_tiles,
    quantize_fp8_tiles_exact,
)
from dsv41.graph.checkpoint.spec import (
    FP8 as FP8_KIND,
)
from dsv41.graph.checkpoint.spec import (
    INDEX_FILE,
    ITEMSIZE,
    RELEASE_FP8_SUFFIX,
    RETURNED_DTYPES,
    GiB,
    TensorSpec,
    fp8_scale_tile,
    param_spec,
    release_fp8_names,
    scale_name,
    vision_spec,
)
from dsv41.graph.config import ModelArgs, load_config

# =============================================================================================
# Reading safetensors files
# =============================================================================================


@dataclass(frozen=True, slots=True)
class _HeaderEntry:
    dtype: str
    shape: tuple[int, ...]
    start: int  # absolute byte offset in the file
    end: int
    key: str  # the name in the file (with its optional `model.` prefix)


@dataclass(frozen=True, slots=True)
class _Header:
    path: Path
    header_bytes: int  # 8-byte length prefix plus the JSON header
    entries: dict[str, _HeaderEntry]


@dataclass(frozen=True, slots=True)
class _Files:
    paths: tuple[Path, ...]  # shards, sorted by name
    index: dict[str, str] | None  # weight_map of model.safetensors.index.json, if present


_MAX_HEADER = 100 << 20  # safetensors' own limit on the JSON header


def _read_header(path: Path) -> _Header:
    """Parse a safetensors header ourselves: it gives dtypes and shapes without touching data,
    so the whole layout can be checked before anything is mapped."""
    size = path.stat().st_size
    with path.open("rb") as f:
        prefix = f.read(8)
        if len(prefix) < 8:
            raise ValueError(f"Checkpoint file {path} is too short to be a safetensors file.")
        n = int.from_bytes(prefix, "little")
        if n > min(size - 8, _MAX_HEADER):
            raise ValueError(f"Checkpoint file {path} has a header length of {n} bytes, which "
                             f"does not fit its size of {size} bytes: not a safetensors file.")
        raw = f.read(n)
    try:
        header = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"Checkpoint file {path} has a header that is not valid JSON: {e}.") from e
    if not isinstance(header, dict):
        raise ValueError(f"Checkpoint file {path} has a header that is not a JSON object.")
    base = 8 + n
    entries: dict[str, _HeaderEntry] = {}
    for key, info in header.items():
        if key == "__metadata__":
            continue
        name = _canonical(key)
        if name in entries:
            raise ValueError(f"Checkpoint file {path} holds tensor {name!r} twice, as "
                             f"{entries[name].key!r} and as {key!r}.")
        entries[name] = _header_entry(path, key, info, base, size)
    return _Header(path, base, entries)


MODEL_PREFIX = "model."  # an optional prefix of every name (`inference/convert.py` strips it)


def _canonical(name: str) -> str:
    """A tensor's name in the layout: the file's name without the optional `model.` prefix."""
    return name[len(MODEL_PREFIX):] if name.startswith(MODEL_PREFIX) else name


def _header_entry(path: Path, name: str, info: object, base: int, size: int) -> _HeaderEntry:
    """Validate one header record; a corrupt record is an error naming the tensor and file."""
    try:
        dtype, shape = str(info["dtype"]), tuple(int(d) for d in info["shape"])
        start, end = (int(o) for o in info["data_offsets"])
    except (TypeError, KeyError, ValueError) as e:
        raise ValueError(f"Tensor {name!r} in {path} has a malformed header record: {info!r}.") \
            from e
    if not 0 <= start <= end <= size - base or any(d < 0 for d in shape):
        raise ValueError(f"Tensor {name!r} in {path} has data offsets [{start}, {end}] outside "
                         f"the file's {size - base} data bytes.")
    if dtype in ITEMSIZE and end - start != math.prod(shape) * ITEMSIZE[dtype]:
        raise ValueError(f"Tensor {name!r} in {path} holds {end - start} bytes, but {dtype} "
                         f"{list(shape)} needs {math.prod(shape) * ITEMSIZE[dtype]}.")
    return _HeaderEntry(dtype, shape, base + start, base + end, name)


def _checkpoint_files(path: Path) -> _Files:
    """The shards of a checkpoint: the files its index names, else every `*.safetensors` in
    the directory, else the file itself."""
    if not path.exists():
        raise ValueError(f"Checkpoint path {path} does not exist.")
    if path.is_file():
        return _Files((path,), None)
    index_path = path / INDEX_FILE
    if index_path.exists():
        weight_map = _read_index(index_path)
        names = sorted(set(weight_map.values()))
        missing = [n for n in names if not (path / n).is_file()]
        if missing:
            lost = [t for t, f in weight_map.items() if f in missing]
            raise ValueError(f"Checkpoint index {index_path} names shard(s) {missing} that do "
                             f"not exist in its directory; they hold {len(lost)} tensor(s): "
                             f"{lost[:5]}{' ...' if len(lost) > 5 else ''}.")
        return _Files(tuple(path / n for n in names), weight_map)
    paths = tuple(sorted(path.glob("*.safetensors"), key=lambda p: p.name))
    if not paths:
        raise ValueError(f"Checkpoint directory {path} holds no *.safetensors files.")
    return _Files(paths, None)


def _read_index(index_path: Path) -> dict[str, str]:
    try:
        weight_map = json.loads(index_path.read_text())["weight_map"]
    except (json.JSONDecodeError, KeyError, TypeError) as e:
        raise ValueError(f"Checkpoint index {index_path} is not valid JSON with a "
                         f"'weight_map' object: {e}.") from e
    if not isinstance(weight_map, dict) or not weight_map:
        raise ValueError(f"Checkpoint index {index_path} has an empty or malformed weight_map.")
    out: dict[str, str] = {}
    for key, file in weight_map.items():
        name = _canonical(str(key))
        if name in out:
            raise ValueError(f"Checkpoint index {index_path} lists tensor {name!r} twice (with "
                             "and without the `model.` prefix).")
        out[name] = str(file)
    return out


def _locate(files: _Files, headers: list[_Header]) -> tuple[dict[str, _Header], list[str]]:
    """Which shard holds each tensor; a name in two shards, or a shard that disagrees with the
    index, is a problem (the loader would otherwise pick one silently)."""
    where: dict[str, _Header] = {}
    problems: list[str] = []
    for h in headers:
        for name in h.entries:
            if name in where:
                problems.append(f"tensor {name!r} is stored in both {where[name].path.name} "
                                f"and {h.path.name}")
                continue
            where[name] = h
            if files.index is not None and files.index.get(name) != h.path.name:
                problems.append(f"tensor {name!r} is stored in {h.path.name} but the index "
                                f"maps it to {files.index.get(name)}")
    if files.index is not None:
        for name, shard in files.index.items():
            if name not in where:
                problems.append(f"tensor {name!r} is listed in the index under {shard} but no "
                                "shard holds it")
    return where, problems


def load_vision(path: str | Path, args: ModelArgs) -> dict[str, torch.Tensor] | None:
    """The vision tower's tensors of a checkpoint, or None when it holds none of them (or
    `vision_n_layers` is 0). A checkpoint with some but not all of them, or with one of the
    wrong dtype or shape, is a ValueError naming every problem."""
    spec = vision_spec(args)
    if not spec:
        return None
    path = Path(path)
    files = _checkpoint_files(path)
    headers = [_read_header(p) for p in files.paths]
    where, problems = _locate(files, headers)
    if not any(name in where for name in spec):
        return None
    problems += _compare(spec, {n: h for n, h in where.items() if n in spec}, True, args)
    if problems:
        raise ValueError(_problem_report(path, problems))
    loaded: dict[str, torch.Tensor] = {}
    for h in headers:
        names = [n for n in h.entries if n in spec and where[n] is h]
        if names:
            loaded.update(_load_shard(h, names))
    return {name: loaded[name] for name in spec}


def _is_vision(name: str) -> bool:
    """Vision-tower tensors of the released checkpoint, which `load_checkpoint` skips."""
    return (name.startswith(("vision.", "aligner.", "image_start", "image_end", "image_newline"))
            or name.endswith(".gate.bias_vl"))


def _compare(spec: Mapping[str, TensorSpec], where: Mapping[str, _Header], strict: bool,
             args: ModelArgs, fp8: Collection[str] = (), converted: Collection[str] = ()
             ) -> list[str]:
    """Every difference between the files and the layout, as one sentence per tensor. `fp8`:
    the tensors stored in the hub's FP8 form (`_release_fp8`), whose scales are expected;
    `converted`: tensors (and scales) made at load from another form (`_kept_fp8`)."""
    problems = []
    scales = {scale_name(n) for n in fp8}
    for name, s in spec.items():
        if name in converted:
            continue
        if name not in where:
            if strict:
                problems.append(f"tensor {name!r} is missing (expected {s.dtype} "
                                f"{list(s.shape)})")
            continue
        got = where[name].entries[name]
        if name in fp8 and got.shape != s.shape:
            problems.append(f"tensor {name!r} in {where[name].path.name} is {got.dtype} "
                            f"{list(got.shape)}, expected {s.dtype} or F8_E4M3 {list(s.shape)}")
        elif name not in fp8 and (got.dtype != s.dtype or got.shape != s.shape):
            problems.append(f"tensor {name!r} in {where[name].path.name} is {got.dtype} "
                            f"{list(got.shape)}, expected {s.dtype} {list(s.shape)}")
    if strict:
        for name, h in where.items():
            if name not in spec and name not in scales and not (
                    args.vision_n_layers > 0 and _is_vision(name)):
                e = h.entries[name]
                problems.append(f"tensor {name!r} in {h.path.name} ({e.dtype} "
                                f"{list(e.shape)}) is not part of the layout for these ModelArgs")
    return problems


def _release_fp8(spec: Mapping[str, TensorSpec], where: Mapping[str, _Header]
                 ) -> tuple[set[str], dict[str, int], list[str]]:
    """The tensors stored in the hub's form (FP8 E4M3 where the layout has BF16, with an E8M0
    `.scale` per square tile), the tile of each whose scale is right, and one sentence per
    scale that is missing, mistyped or of a shape that fits no square tile."""
    stored = {n for n in release_fp8_names(spec)
              if n in where and where[n].entries[n].dtype == "F8_E4M3"}
    tiles: dict[str, int] = {}
    problems = []
    for name in sorted(stored):
        w, scale = where[name].entries[name], scale_name(name)
        if scale not in where:
            problems.append(f"tensor {name!r} in {where[name].path.name} is F8_E4M3 but its "
                            f"scale {scale!r} is missing")
            continue
        e = where[scale].entries[scale]
        tile = fp8_scale_tile(w.shape, e.shape)
        if e.dtype != "F8_E8M0" or tile is None:
            problems.append(
                f"tensor {scale!r} in {where[scale].path.name} is {e.dtype} {list(e.shape)}, "
                f"expected F8_E8M0 with one scale per square tile of {name!r} {list(w.shape)} "
                f"(e.g. {[-(-d // 32) for d in w.shape]} for 32x32 tiles)")
        elif w.shape == spec[name].shape:
            tiles[name] = tile
    return stored, tiles, problems


def _kept_fp8(spec: Mapping[str, TensorSpec], where: Mapping[str, _Header]
              ) -> tuple[dict[str, int], list[str]]:
    """The layout's FP8 `wo_a` tensors (`ModelArgs.wo_a_dtype` "fp8") that the files store in
    another form, to be converted at load: name -> the tile of their FP8 scale (another square
    tile than the layout's 32), or 0 where they are BF16 (`inference/convert.py`'s layout);
    and one sentence per such tensor whose scale fits no square tile."""
    kept: dict[str, int] = {}
    problems = []
    for name, s in spec.items():
        if not (name.endswith(RELEASE_FP8_SUFFIX) and s.kind == FP8_KIND) or name not in where:
            continue
        got = where[name].entries[name]
        if got.shape != s.shape:
            continue  # `_compare` reports it
        if got.dtype == "BF16":
            kept[name] = 0
            continue
        scale = scale_name(name)
        if got.dtype != "F8_E4M3" or scale not in where:
            continue
        e = where[scale].entries[scale]
        if e.shape == spec[scale].shape:
            continue  # the layout's own form
        tile = fp8_scale_tile(got.shape, e.shape)
        if e.dtype != "F8_E8M0" or tile is None:
            problems.append(f"tensor {scale!r} in {where[scale].path.name} is {e.dtype} "
                            f"{list(e.shape)}, expected F8_E8M0 with one scale per square tile "
                            f"of {name!r} {list(got.shape)}")
        else:
            kept[name] = tile
    return kept, problems


def _read_kept_fp8(reader: _Reader, where: Mapping[str, _Header], name: str, tile: int
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """A `_kept_fp8` tensor read and converted on the CPU to the layout's FP8 of 32 x 32 tiles,
    exactly (`quantize_fp8_tiles_exact`: ValueError where no such form holds its values)."""
    cpu = torch.device("cpu")
    stored = (_read_fp8(reader, where, name, tile, None, cpu) if tile
              else reader.read(where[name], name, _empty(where[name].entries[name], cpu)))
    return quantize_fp8_tiles_exact(stored, name)


def _problem_report(path: Path, problems: list[str], limit: int = 20) -> str:
    lines = [f"  - {p}" for p in problems[:limit]]
    if len(problems) > limit:
        lines.append(f"  ... and {len(problems) - limit} more")
    return (f"Checkpoint {path} does not match the tensor layout of its ModelArgs "
            f"({len(problems)} problem(s)):\n" + "\n".join(lines))


def _bit_route(t: torch.Tensor, dtype: str, name: str) -> torch.Tensor:
    """Reinterpret (never convert) a loaded tensor as the representation dsv41 uses."""
    want = RETURNED_DTYPES[dtype]
    if t.dtype != want:
        assert t.element_size() == torch.empty(0, dtype=want).element_size(), (
            f"{name}: cannot view {t.dtype} as {want}")
        t = t.view(want)
    return t


def _load_shard_safetensors(header: _Header, names: list[str]) -> dict[str, torch.Tensor]:
    """safetensors maps the whole file (MAP_PRIVATE) and hands out views into that mapping."""
    out = {}
    with safe_open(str(header.path), framework="pt") as f:
        for name in names:
            e = header.entries[name]
            out[name] = _bit_route(f.get_tensor(e.key), e.dtype, name)
    return out


def _load_shard_mmap(header: _Header, names: list[str]) -> dict[str, torch.Tensor]:
    """Fallback for a torch/safetensors pair that cannot produce some dtype: map the file
    ourselves and view the raw bytes. A tensor whose offset is not aligned to its element size
    cannot be viewed in place and is copied (safetensors' own writer always aligns)."""
    size = header.path.stat().st_size
    storage = torch.UntypedStorage.from_file(str(header.path), shared=False, nbytes=size)
    whole = torch.empty(0, dtype=torch.uint8).set_(storage, 0, (size,))
    out = {}
    for name in names:
        e = header.entries[name]
        raw = whole[e.start:e.end]
        want = RETURNED_DTYPES[e.dtype]
        itemsize = ITEMSIZE[e.dtype]
        if e.start % itemsize:
            raw = raw.clone()
        out[name] = raw.view(want).view(e.shape)
    return out


def _load_shard(header: _Header, names: list[str]) -> dict[str, torch.Tensor]:
    try:
        return _load_shard_safetensors(header, names)
    except Exception:  # noqa: BLE001 -- any failure of the fast path: retry with our own reader
        return _load_shard_mmap(header, names)


ALIGNMENT = 64  # bytes: TVM imports a tensor by DLPack only at this alignment


def load_checkpoint(path: str | Path, args: ModelArgs, *, strict: bool = True,
                    device: str | torch.device = "cpu",
                    stacks: Mapping[str, Sequence[str]] | None = None,
                    owned: Collection[str] = (),
                    only: Collection[str] | None = None,
                    slices: Mapping[str, tuple[int, int, int]] | None = None,
                    host: Collection[str] = ()) -> dict[str, torch.Tensor]:
    """Load a checkpoint directory (one file or shards, with or without an index), in the
    converted layout or the hub's (`release`): names may carry a `model.` prefix, and a
    `release_fp8_names` tensor (`wo_a`) stored as FP8 E4M3 + E8M0 `.scale` is dequantized
    once, here, to the BF16 of the layout (`dequantize_fp8_tiles`, its tile read from the
    scale's shape), into an allocation of its own: at `full` size 43 x 8192 x 4096, 1.34 GiB
    of FP8 read, 2.69 GiB of BF16 made, ~0.41 s per layer on 2 CPU threads (~18 s in all).

    The whole layout is checked from the headers first, and every problem is reported in one
    ValueError (a missing, unexpected, mistyped or misshaped tensor names the tensor, the file
    and both dtypes/shapes), so a bad checkpoint is fixed in one round. `strict=False` allows
    missing and unexpected tensors (unexpected ones are not returned); a name stored twice or a
    wrong dtype/shape is always an error. Returns tensors in `param_spec` order as uint8 /
    bfloat16 / float32 (see the module docstring), each stored once in memory:

    - on the CPU, a tensor whose data is 64-byte aligned in its file is a view of the
      memory-mapped file (no copy; its pages become resident when read);
    - every other tensor (unaligned on the CPU, any on another `device`, those named in `owned`,
      the members of `stacks`) is read from the file straight into its own allocation on
      `device` (on a GPU through a bounded pinned staging buffer), never through the mapping,
      so the host holds no second copy;
    - `stacks` maps a new name to member names of one dtype and shape: the result holds that
      name, the members stacked on a leading axis in the order given (written in place, member
      by member), and not the members. A stack with a missing member is not returned;
    - `only` (a sharded worker's tensors): nothing else is read or returned (stack members
      count as named);
    - `slices` maps a name to (dim, start, stop): only that slice of dims 0 or 1 is read, from
      the file straight into an allocation of the slice's size (the whole tensor is never
      read), and returned under the name;
    - `host` names tensors that stay in host memory whatever `device` is (the Engram tables,
      `engram.host_resident`): loaded as on the CPU (views of the mapping when aligned).
    """
    path = Path(path)
    device = torch.device(device)
    files = _checkpoint_files(path)
    headers = [_read_header(p) for p in files.paths]
    where, problems = _locate(files, headers)
    spec = param_spec(args)
    fp8, tiles, fp8_problems = _release_fp8(spec, where)
    kept, kept_problems = _kept_fp8(spec, where)
    converted = set(kept) | {scale_name(n) for n in kept}
    problems += _compare(spec, where, strict, args, fp8, converted) + fp8_problems + kept_problems
    problems += _stack_problems(spec, stacks or {})
    if problems:
        raise ValueError(_problem_report(path, problems))
    members = {m for names in (stacks or {}).values() for m in names}
    slices = slices or {}
    for name, (dim, start, stop) in slices.items():
        shape = spec[name].shape if name in spec else ()
        if dim not in (0, 1) or dim >= len(shape) or not 0 <= start < stop <= shape[dim]:
            raise ValueError(f"The slice ({dim}, {start}, {stop}) of {name} is not a slice of "
                             f"dims 0 or 1 of its stored shape {shape}.")
    with _Reader(device) as reader:
        loaded: dict[str, torch.Tensor] = {}
        for h in headers:
            names = [n for n in h.entries if n in spec and n not in members and where[n] is h
                     and n not in tiles and n not in converted and (only is None or n in only)]
            for n in names:
                if n in slices:
                    loaded[n] = reader.read_slice(h, n, *slices[n])
            mapped = [n for n in names if (device.type == "cpu" or n in host)
                      and n not in owned and n not in slices
                      and h.entries[n].start % ALIGNMENT == 0]
            if mapped:
                loaded.update(_load_shard(h, mapped))
            for n in names:
                if n not in loaded:
                    on = torch.device("cpu") if n in host else device
                    loaded[n] = reader.read(h, n, _empty(h.entries[n], on))
        for n, tile in tiles.items():
            if only is None or n in only:
                loaded[n] = _read_fp8(reader, where, n, tile, slices.get(n),
                                      torch.device("cpu") if n in host else device)
        for n, tile in kept.items():
            wanted = [t for t in (n, scale_name(n)) if only is None or t in only]
            if wanted:
                made = dict(zip((n, scale_name(n)), _read_kept_fp8(reader, where, n, tile),
                                strict=True))
                for t in wanted:
                    piece = slices.get(t)
                    part = made[t] if piece is None else made[t].narrow(
                        piece[0], piece[1], piece[2] - piece[1]).contiguous()
                    loaded[t] = part.to(torch.device("cpu") if t in host else device)
        for n, s in spec.items():  # the FP8 wo_a read as stored: decodable as the kernels do
            if n.endswith(RELEASE_FP8_SUFFIX) and s.kind == FP8_KIND and n in loaded \
                    and scale_name(n) in loaded and n not in kept:
                check_fp8_tiles(loaded[n], loaded[scale_name(n)], n)
        out = {name: loaded[name] for name in spec if name in loaded}
        for name, group in (stacks or {}).items():
            if all(m in where for m in group):
                first = where[group[0]].entries[group[0]]
                stack = torch.empty((len(group), *first.shape), dtype=RETURNED_DTYPES[
                    first.dtype], device=device)
                for i, m in enumerate(group):
                    reader.read(where[m], m, stack[i])
                out[name] = stack
    return out


def _read_fp8(reader: _Reader, where: Mapping[str, _Header], name: str, tile: int,
              piece: tuple[int, int, int] | None, device: torch.device) -> torch.Tensor:
    """A tensor stored in the hub's FP8 form, read and dequantized on the CPU to the BF16 the
    graph uses (then sliced to `piece` and moved to `device`): its own allocation, never a
    view of the file."""
    cpu = torch.device("cpu")
    scale = scale_name(name)
    codes = reader.read(where[name], name, _empty(where[name].entries[name], cpu))
    scales = reader.read(where[scale], scale, _empty(where[scale].entries[scale], cpu))
    out = dequantize_fp8_tiles(codes, scales, tile)
    if piece is not None:
        dim, start, stop = piece
        out = out.narrow(dim, start, stop - start).contiguous()
    return out.to(device)


def _stack_problems(spec: Mapping[str, TensorSpec], stacks: Mapping[str, Sequence[str]]
                    ) -> list[str]:
    problems = []
    for name, group in stacks.items():
        specs = {(spec[m].dtype, spec[m].shape) if m in spec else None for m in group}
        if not group or None in specs or len(specs) != 1 or name in spec:
            problems.append(f"stack {name!r} needs a new name and members of the layout with "
                            f"one dtype and shape, got {list(group)[:3]}")
    return problems


def _empty(e: _HeaderEntry, device: torch.device) -> torch.Tensor:
    return torch.empty(e.shape, dtype=RETURNED_DTYPES[e.dtype], device=device)


class _Reader:
    """Reads tensors from their files into allocations of the caller's: directly on the CPU
    (`os.preadv` into the tensor's memory), through one pinned staging buffer of at most
    `STAGING_BYTES` elsewhere. Files stay open for the whole load."""

    STAGING_BYTES = 64 << 20

    def __init__(self, device: torch.device):
        self.device = device
        self._files: dict[Path, int] = {}
        self._staging: torch.Tensor | None = None

    def __enter__(self) -> _Reader:
        return self

    def __exit__(self, *exc) -> None:
        for fd in self._files.values():
            os.close(fd)
        self._files.clear()

    def _fd(self, path: Path) -> int:
        if path not in self._files:
            self._files[path] = os.open(path, os.O_RDONLY)
        return self._files[path]

    def read_slice(self, header: _Header, name: str, dim: int, start: int,
                   stop: int) -> torch.Tensor:
        """Rows (dim 0) or columns (dim 1) start..stop of `name`, read into a new tensor of
        that size on the CPU (one read for rows, one per row for columns), then moved to the
        reader's device."""
        e = header.entries[name]
        shape = list(e.shape)
        shape[dim] = stop - start
        out = torch.empty(shape, dtype=RETURNED_DTYPES[e.dtype])
        flat = out.view(-1).view(torch.uint8).numpy()
        unit = ITEMSIZE[e.dtype] * math.prod(e.shape[dim + 1:])  # bytes per index of `dim`
        fd = self._fd(header.path)
        if dim == 0:
            _pread_into(fd, e.start + start * unit, flat, header.path, name)
        else:
            row, piece = unit * e.shape[1], unit * (stop - start)
            for i in range(e.shape[0]):
                _pread_into(fd, e.start + i * row + start * unit,
                            flat[i * piece:(i + 1) * piece], header.path, name)
        return out if self.device.type == "cpu" else out.to(self.device)

    def read(self, header: _Header, name: str, dest: torch.Tensor) -> torch.Tensor:
        """Fill `dest` (contiguous, of the tensor's size) with `name`'s bytes; returns it."""
        e = header.entries[name]
        flat = dest.view(-1).view(torch.uint8) if dest.numel() else dest.view(torch.uint8)
        assert flat.numel() == e.end - e.start, f"{name}: destination of the wrong size"
        fd = self._fd(header.path)
        if dest.device.type == "cpu":
            _pread_into(fd, e.start, flat.numpy(), header.path, name)
            return dest
        if self._staging is None:
            self._staging = torch.empty(self.STAGING_BYTES, dtype=torch.uint8, pin_memory=True)
        for off in range(0, flat.numel(), self.STAGING_BYTES):
            n = min(self.STAGING_BYTES, flat.numel() - off)
            _pread_into(fd, e.start + off, self._staging[:n].numpy(), header.path, name)
            flat[off:off + n].copy_(self._staging[:n])
        return dest


def _pread_into(fd: int, offset: int, buf: np.ndarray, path: Path, name: str) -> None:
    view = memoryview(buf).cast("B")
    done = 0
    while done < len(view):
        n = os.preadv(fd, [view[done:]], offset + done)
        if n <= 0:
            raise ValueError(f"Checkpoint file {path} ended while reading tensor {name!r} "
                             f"({done} of {len(view)} bytes read).")
        done += n


def checkpoint_config(path: str | Path) -> ModelArgs:
    """The ModelArgs of a checkpoint, from the `config.json` next to its weights."""
    path = Path(path)
    return load_config(path.parent if path.is_file() else path)


# =============================================================================================
# Fingerprint
# =============================================================================================

_FULL_HASH_LIMIT = GiB
_SAMPLE_COUNT = 64
_SAMPLE_BYTES = 64 << 10


def _file_digest_parts(path: Path) -> Iterator[bytes]:
    """The bytes that identify one shard: all of them up to 1 GiB; above that the header, the
    size and 64 evenly spaced 64 KiB chunks (first and last included), which still catches any
    re-quantisation or re-seeding (they change bytes everywhere) while reading ~4 MiB instead of
    hundreds of GB."""
    size = path.stat().st_size
    yield path.name.encode() + b"\0" + size.to_bytes(8, "little")
    with path.open("rb") as f:
        if size <= _FULL_HASH_LIMIT:
            while chunk := f.read(16 << 20):
                yield chunk
            return
        n = int.from_bytes(f.read(8), "little")
        f.seek(0)
        yield f.read(8 + min(n, _MAX_HEADER))
        span = size - _SAMPLE_BYTES
        for i in range(_SAMPLE_COUNT):
            f.seek(i * span // (_SAMPLE_COUNT - 1))
            yield f.read(_SAMPLE_BYTES)


def weights_fingerprint(path: str | Path) -> str:
    """sha256 (hex) identifying the weight files of a checkpoint, to salt persistent cache keys.

    Covers the shards the loader reads, sorted by file name, each by its name, size and content
    (all bytes up to 1 GiB, else header + 64 evenly spaced 64 KiB chunks). No mtimes, no absolute
    paths: the same files give the same fingerprint on any machine. Resharding the same weights
    changes it (the files differ), which only costs a cache refill.
    """
    files = _checkpoint_files(Path(path))
    h = hashlib.sha256(b"dsv41-weights-fingerprint-v1\0")
    for p in files.paths:
        for part in _file_digest_parts(p):
            h.update(part)
    return h.hexdigest()

