"""from_pretrained: rebuild a low-rank Hugging Face model from its ``save_pretrained`` folder.

``save_pretrained`` of a converted model stores each low-rank layer's factors
(``<layer>.U`` (out, r), ``.S`` (r, r), ``.V`` (in, r), ``.bias``, SDLRT's ``.U_buf`` /
``.V_buf``) beside the config. HF's own ``from_pretrained`` builds the dense architecture, finds
none of those keys and leaves the layers randomly initialised (it only logs the missing keys):
a different model. :func:`from_pretrained` builds the same architecture, converts exactly the
saved layers at their saved ranks and loads every tensor.

Every file is read as one a stranger may have written: regular files only (a FIFO or a device
is refused at once instead of hanging), inside the folder (an index naming ``../x`` or an
absolute path is refused), bounded (the index and configs at :data:`rankwise._io.SMALL_FILE`,
a safetensors header at :data:`HEADER_LIMIT`, every tensor's declared bytes within its file),
and every saved shape is compared with the model's before any tensor is allocated.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import sys
from collections.abc import Iterator
from pathlib import Path, PurePath

import torch
from torch import Tensor, nn

from .._io import SMALL_FILE, open_regular, read_json
from ._convert import to_low_rank

_FACTORS = ("U", "S", "V")
HEADER_LIMIT = 100 << 20  # bytes: safetensors' own limit on a header
_DTYPES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16", "I64": "int64",
           "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool", "U16": "uint16",
           "U32": "uint32", "U64": "uint64", "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2",
           "C64": "complex64"}


def from_pretrained(model_class, path: str | Path, *, dtype: torch.dtype | None = None,
                    max_rank: int | None = None) -> nn.Module:
    """The low-rank model that ``model.save_pretrained(path)`` stored, converted model included.

    The model is built from the saved config (``model_class(config)``, or
    ``model_class.from_config(config)`` for an ``AutoModel...`` class) with its parameters on
    the meta device (no memory, no initialisation; buffers such as rotary tables are built as
    usual), every layer with saved factors is converted at its saved rank
    (``to_low_rank(model, rank={name: r})``, r = the saved ``S``'s size, so layers whose ranks
    training changed come back at those ranks; on meta: no SVD), every saved shape is compared
    with the model's, and only then are the saved tensors read and put in place
    (``load_state_dict(assign=True)``), strictly: each saved key must fit the model and each
    parameter must be loaded, except a tied weight that ``save_pretrained`` stored once (an
    ``lm_head`` tied to the embedding; the tie is kept). As HF's ``from_pretrained``:
    ``config.name_or_path`` (and ``model.name_or_path``) is `path`, a ``generation_config.json``
    beside the weights becomes ``model.generation_config``, and the model is in eval mode.

    **Arguments:**
    - `model_class`: the Hugging Face model class the model was (``GPT2LMHeadModel``,
      ``LlamaForCausalLM``, ``BertForSequenceClassification``) or an auto class
      (``AutoModelForCausalLM``).
    - `path`: the folder ``save_pretrained`` wrote (``model.safetensors`` or
      ``pytorch_model.bin``, sharded or not, and ``config.json``). Local only: nothing is
      downloaded. Every file read must be a regular file in that folder (a link is followed
      when it stays inside it, or, in a Hugging Face cache snapshot, leads into the cache's
      ``blobs``); ``config.json``, ``generation_config.json`` and an index hold at most
      16 MiB.
    - `dtype`: the dtype to build in; default: that of the saved floating-point tensors.
    - `max_rank`: the layers' cap for later rank growth (it is not in the saved tensors;
      default min(out, in) per layer, as :func:`to_low_rank`).

    **Returns:** the model, in eval mode (as HF's ``from_pretrained``).

    **Raises:** ``FileNotFoundError`` without a weights file or config; ``ValueError`` when the
    folder holds no low-rank factors (load it with ``model_class.from_pretrained``), when saved
    keys or shapes and the model's do not match (naming them; before anything is allocated),
    or when a file is not one a loader may read (a FIFO, a link or index entry leading outside
    the folder, an oversized or too deeply nested index, a safetensors header whose tensors
    do not fit the file), naming the file.
    """
    path = Path(path)
    files = _weight_files(path)
    headers = {}
    for file in files:
        for k, v in _header(file).items():
            if k in headers:
                raise ValueError(f"{file} holds {k!r}, which another weights file in {path} holds too")
            headers[k] = v
    shapes = {k: tuple(v[1]) for k, v in headers.items()}
    ranks = saved_ranks(shapes)
    if not ranks:
        cls = getattr(model_class, "__name__", "the class")
        raise ValueError(f"{path} holds no low-rank factors (no '<layer>.U/.S/.V' keys): it is a dense "
                         f"model, load it with {cls}.from_pretrained")
    config = _config(model_class, path)
    with _parameters_on_meta():
        if isinstance(model_class, type) and issubclass(model_class, nn.Module):
            model = model_class(config)
        else:
            model = model_class.from_config(config)
    floating = [d for d, _, _ in headers.values() if d.is_floating_point]
    dtype = dtype or (floating[0] if floating else torch.get_default_dtype())
    model.to(dtype)
    _check_layers(model, shapes, ranks, path)
    to_low_rank(model, rank=ranks, max_rank=max_rank)  # on meta: at the saved ranks, no SVD
    _check_shapes(model, shapes, path)
    state = {k: (t.to(dtype) if t.is_floating_point() else t) for k, t in _read_tensors(headers).items()}
    _load_strictly(model, state, path)
    _restore_generation_config(model, path)
    return model.eval()


def saved_ranks(state: dict[str, Tensor] | dict[str, tuple]) -> dict[str, int]:
    """``{layer name: rank}`` of the low-rank layers in a state dict, or in ``{key: shape}``
    (those with U, S and V)."""
    def shape(k):
        v = state[k]
        return tuple(v.shape) if torch.is_tensor(v) else tuple(v)

    names = {k.rpartition(".")[0] for k in state if k.rpartition(".")[2] == "S"}
    return {n: shape(f"{n}.S")[0] for n in sorted(names)
            if all(f"{n}.{f}" in state for f in _FACTORS) and len(shape(f"{n}.S")) == 2}


def read_state_dict(path: Path) -> dict[str, Tensor]:
    """The tensors of a ``save_pretrained`` folder: safetensors or ``pytorch_model.bin``, sharded
    or not, each file checked as :func:`from_pretrained` does."""
    out: dict[str, Tensor] = {}
    for file in _weight_files(Path(path)):
        out.update(_read_tensors(_header(file)))
    return out


# ----------------------------------------------------------------------------- files
def _weight_files(path: Path) -> list[Path]:
    """The weights files of the folder: one file, or the shards its index names (checked)."""
    for name in ("model.safetensors", "pytorch_model.bin"):
        if (path / name).exists() or (path / name).is_symlink():
            return [_inside(path, name, "the weights file")]
        index = path / f"{name}.index.json"
        if index.exists() or index.is_symlink():
            data = read_json(_inside(path, index.name, "the index"), SMALL_FILE)
            weight_map = data.get("weight_map") if isinstance(data, dict) else None
            if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
                raise ValueError(f"{index} is not a weights index: it has no 'weight_map' of tensor names to "
                                 "file names")
            return [_inside(path, shard, f"a shard named in {index.name}")
                    for shard in sorted(set(weight_map.values()))]
    raise FileNotFoundError(f"no model.safetensors or pytorch_model.bin (or a sharded index) in {path}")


def _inside(folder: Path, name: str, what: str) -> Path:
    """`folder`/`name` resolved, refused (``ValueError``) when `name` is absolute or climbs out
    (``..``), or when links lead outside `folder` (but into a Hugging Face cache snapshot's
    ``blobs``, where the hub keeps every file of a snapshot)."""
    parts = PurePath(name).parts
    if not name or "\x00" in name or PurePath(name).is_absolute() or PurePath(name).drive or ".." in parts:
        raise ValueError(f"{what} {name!r} is not a file name inside {folder}: refusing to read outside the "
                         "folder (a weights folder names its own files)")
    root = folder.resolve()
    real = (folder / name).resolve()
    if real.is_relative_to(root):
        return real
    if root.parent.name == "snapshots" and real.is_relative_to(root.parent.parent / "blobs"):
        return real  # huggingface_hub's cache: snapshots/<rev>/<file> -> ../../blobs/<hash>
    raise ValueError(f"{what} {name!r} in {folder} is a link to {real}, outside the folder: refusing to read "
                     "it (copy the file into the folder)")


def _pread_into(fd: int, buf: memoryview, offset: int, file: Path) -> None:
    got = 0
    while got < len(buf):
        n = os.preadv(fd, [buf[got:]], offset + got)
        if n == 0:
            raise ValueError(f"{file} shrank while it was read")
        got += n


# header entries: key -> (dtype, shape, (file, start, nbytes)); a .bin's: (dtype, shape, tensor)
_AS_WEIGHTS = ": refusing to read it as weights"  # (the end of a non-regular file's refusal)


def _header(file: Path) -> dict[str, tuple]:
    if file.suffix == ".bin":
        return _bin_header(file)
    with open_regular(file, what=_AS_WEIGHTS) as (fd, size):
        if size < 8:
            raise ValueError(f"{file} is {size} bytes: too short for a safetensors file")
        n = int.from_bytes(os.pread(fd, 8, 0), "little")
        if n > HEADER_LIMIT or 8 + n > size:
            raise ValueError(f"{file} declares a {n:,}-byte safetensors header in a {size:,}-byte file "
                             f"(at most {HEADER_LIMIT:,}): not a safetensors file this loader reads")
        buf = bytearray(n)
        _pread_into(fd, memoryview(buf), 8, file)
    try:
        raw = json.loads(buf)
    except RecursionError:
        raise ValueError(f"{file}'s safetensors header is nested too deep to read") from None
    except (ValueError, UnicodeDecodeError) as e:
        raise ValueError(f"{file}'s safetensors header is not JSON ({e})") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{file}'s safetensors header is not a JSON object")
    data_size, out = size - 8 - n, {}
    for key, entry in raw.items():
        if key == "__metadata__":
            continue
        out[key] = _entry(file, key, entry, data_size, 8 + n)
    return out


def _entry(file: Path, key: str, entry, data_size: int, base: int) -> tuple:
    """One safetensors header entry, checked: a known dtype, a shape of whole numbers >= 0, and
    data offsets inside the file that span exactly the shape's bytes."""
    bad = f"{file}: tensor {key!r} in the safetensors header"
    name = entry.get("dtype") if isinstance(entry, dict) else None
    if name not in _DTYPES or not hasattr(torch, _DTYPES[name]):
        raise ValueError(f"{bad} has no dtype this loader knows ({name!r})")
    shape, offsets = entry.get("shape"), entry.get("data_offsets")
    if not (isinstance(shape, list) and all(type(d) is int and d >= 0 for d in shape)):
        raise ValueError(f"{bad} has shape {shape!r}, not a list of whole numbers >= 0")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(type(o) is int for o in offsets)
            and 0 <= offsets[0] <= offsets[1] <= data_size):
        raise ValueError(f"{bad} has data offsets {offsets!r} outside the file's {data_size:,} data bytes")
    dtype = getattr(torch, _DTYPES[entry["dtype"]])
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if offsets[1] - offsets[0] != nbytes:
        raise ValueError(f"{bad} declares shape {tuple(shape)} ({nbytes:,} bytes) but holds "
                         f"{offsets[1] - offsets[0]:,} bytes: the file is damaged or not a safetensors file")
    return dtype, tuple(shape), (file, base + offsets[0], nbytes)


def _bin_header(file: Path) -> dict[str, tuple]:
    """A ``pytorch_model.bin``: torch.load (weights only) reads it whole (a pickle has no header
    to check first); the shapes are compared after."""
    with open_regular(file, what=_AS_WEIGHTS) as (fd, _), os.fdopen(os.dup(fd), "rb") as f:
        state = torch.load(f, map_location="cpu", weights_only=True)
    if not isinstance(state, dict) or not all(isinstance(k, str) and torch.is_tensor(v)
                                              for k, v in state.items()):
        raise ValueError(f"{file} is not a state dict (names to tensors)")
    return {k: (v.dtype, tuple(v.shape), v) for k, v in state.items()}


def _read_tensors(headers: dict[str, tuple]) -> dict[str, Tensor]:
    """The tensors the headers describe, each read from its file (regular, checked again) into
    memory of exactly its declared size."""
    if sys.byteorder != "little":
        raise ValueError("reading safetensors files needs a little-endian machine")
    out, by_file = {}, {}
    for k, (dtype, shape, where) in headers.items():
        if torch.is_tensor(where):
            out[k] = where
        else:
            by_file.setdefault(where[0], []).append((k, dtype, shape, where[1], where[2]))
    for file, entries in by_file.items():
        with open_regular(file, what=_AS_WEIGHTS) as (fd, size):
            for k, dtype, shape, start, nbytes in entries:
                if start + nbytes > size:
                    raise ValueError(f"{file} shrank while it was read")
                raw = torch.empty(nbytes, dtype=torch.uint8)
                if nbytes:
                    _pread_into(fd, memoryview(raw.numpy()), start, file)
                out[k] = raw.view(dtype).reshape(shape)
    return out


def _config(model_class, path: Path):
    """The saved config, read as a bounded regular file in the folder, with ``name_or_path`` set
    to `path` (as HF's loader sets it)."""
    from transformers import CONFIG_MAPPING, PretrainedConfig

    file = path / "config.json"
    if not (file.exists() or file.is_symlink()):
        raise FileNotFoundError(f"no config.json in {path}")
    data = read_json(_inside(path, "config.json", "the config"), SMALL_FILE)
    if not isinstance(data, dict):
        raise ValueError(f"{file} is not a JSON object")
    cls = getattr(model_class, "config_class", None)
    if not (isinstance(cls, type) and issubclass(cls, PretrainedConfig)) or cls is PretrainedConfig:
        kind = data.get("model_type")
        if kind not in CONFIG_MAPPING:
            raise ValueError(f"{file} names model_type {kind!r}, which transformers does not know")
        cls = CONFIG_MAPPING[kind]
    config = cls.from_dict(data)
    config.name_or_path = str(path)
    return config


def _restore_generation_config(model: nn.Module, path: Path) -> None:
    """``generation_config.json`` beside the weights, as HF's loader restores it."""
    file = path / "generation_config.json"
    can = getattr(model, "can_generate", None)
    if not (callable(can) and can()) or not (file.exists() or file.is_symlink()):
        return
    from transformers import GenerationConfig

    data = read_json(_inside(path, file.name, "the generation config"), SMALL_FILE)
    if not isinstance(data, dict):
        raise ValueError(f"{file} is not a JSON object")
    model.generation_config = GenerationConfig.from_dict(data)


# ----------------------------------------------------------------------------- the model
@contextlib.contextmanager
def _parameters_on_meta() -> Iterator[None]:
    """Every parameter registered meanwhile is moved to the meta device (its initialisation then
    costs nothing); buffers stay real (a rotary table computed in ``__init__`` is not saved)."""
    register = nn.Module.register_parameter

    def on_meta(module, name, param):
        register(module, name, param)
        p = module._parameters.get(name)
        if p is not None and not p.is_meta:
            module._parameters[name] = type(p)(p.to("meta"), requires_grad=p.requires_grad)

    nn.Module.register_parameter = on_meta
    try:
        yield
    finally:
        nn.Module.register_parameter = register


def _check_layers(model: nn.Module, shapes: dict[str, tuple], ranks: dict[str, int], path: Path) -> None:
    """Before any conversion or allocation: each saved low-rank layer is a layer of the model,
    its factors' shapes are U (out, r), S (r, r), V (in, r) with 1 <= r <= min(out, in)."""
    modules = dict(model.named_modules())
    for name, r in ranks.items():
        mod, (parent, _, proj) = modules.get(name), name.rpartition(".")
        w = getattr(mod, "weight", None)
        if isinstance(modules.get(parent), nn.MultiheadAttention) and proj in ("q_proj", "k_proj", "v_proj"):
            mha = modules[parent]  # its projections are converted by name (one low-rank layer each)
            out, inn = mha.embed_dim, {"q_proj": mha.embed_dim, "k_proj": mha.kdim, "v_proj": mha.vdim}[proj]
        elif mod is None or not torch.is_tensor(w) or w.dim() < 2:
            raise ValueError(f"{path} holds low-rank factors for {name!r}, which is not a layer with a "
                             "weight matrix in the model its config builds (saved from this model class?)")
        else:
            conv1d = type(mod).__name__ == "Conv1D"
            out, inn = (w.shape[1], w.shape[0]) if conv1d else (w.shape[0], w[0].numel())
        want = {"U": (out, r), "S": (r, r), "V": (inn, r)}
        got = {f: shapes[f"{name}.{f}"] for f in _FACTORS}
        if not 1 <= r <= min(out, inn) or got != want:
            raise ValueError(f"{path}: layer {name!r} ({out}×{inn}) has saved factors U {got['U']}, "
                             f"S {got['S']}, V {got['V']}; a layer of rank r needs U ({out}, r), S (r, r), "
                             f"V ({inn}, r) with 1 <= r <= {min(out, inn)}: the file does not fit this model")


def _check_shapes(model: nn.Module, shapes: dict[str, tuple], path: Path) -> None:
    """Every saved tensor's shape against the converted (meta) model's, before any is read."""
    mine = {k: tuple(v.shape) for k, v in model.state_dict(keep_vars=True).items()}
    for k, s in shapes.items():
        pair = k[:-len("U_buf")] + "V_buf" if k.endswith(".U_buf") else None
        if pair in shapes and (len(s) != 2 or len(shapes[pair]) != 2 or s[1] != shapes[pair][1]):
            raise ValueError(f"{path}: {k!r} {s} and {pair!r} {shapes[pair]} must be (out, b) and (in, b), "
                             "one width b: the file does not fit this model")
        want = mine.get(k)
        if k.endswith(("U_buf", "V_buf")) and want is not None and s[:1] == want[:1] and len(s) == 2:
            continue  # SDLRT's buffers: (out, b), (in, b) at the width they had
        if want is not None and s != want:
            raise ValueError(f"{path}: {k!r} is saved with shape {s} but the model its config builds has "
                             f"{want} (is config.json the one saved with these weights?)")


def _load_strictly(model: nn.Module, state: dict[str, Tensor], path: Path) -> None:
    """``load_state_dict(assign=True)`` that tolerates only missing keys of tied parameters stored
    under another name; the ties are kept, zero-sized buffers never saved are made real."""
    groups: dict[int, list[str]] = {}
    for n, p in model.named_parameters(remove_duplicate=False):
        groups.setdefault(id(p), []).append(n)
    missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
    stored = {i for i, names in groups.items() if any(n in state for n in names)}
    params = {n: i for i, names in groups.items() for n in names}
    missing = [k for k in missing if k not in params or params[k] not in stored]
    if missing or unexpected:
        raise ValueError(f"the tensors in {path} do not fit the rebuilt model: missing {missing[:8]}, "
                         f"unexpected {unexpected[:8]} (was it saved from this model class?)")
    for names in groups.values():  # tied: every name the loaded parameter
        loaded = next((n for n in names if n in state), None)
        if loaded is not None and len(names) > 1:
            p = model.get_parameter(loaded)
            for n in names:
                owner, _, attr = n.rpartition(".")
                model.get_submodule(owner)._parameters[attr] = p
    for name, b in list(model.named_buffers()):
        if b is not None and b.is_meta and b.numel() == 0:
            owner, _, attr = name.rpartition(".")
            model.get_submodule(owner)._buffers[attr] = torch.empty(b.shape, dtype=b.dtype)
    left = [n for n, t in (*model.named_parameters(), *model.named_buffers()) if t.is_meta]
    if left:
        raise ValueError(f"the tensors in {path} leave {left[:8]} without values (was it saved from this "
                         "model class?)")
