"""The offline tiny model: a real tokenizer and a small Qwen3 LM, built in-process.

Tests and the demo need a causal LM with a real tokenizer and a Qwen-style chat
template, without the network. `tiny_model_path()` builds one from files the
package ships and caches it on disk, where `from_pretrained` loads it like any
hub checkpoint. What it simplifies, compared with a real Qwen checkpoint:

1. **Tokenizer.** A byte-level BPE (GPT-2 pre-tokenizer, as Qwen) trained in a
   fraction of a second on `data/tiny_corpus.txt`, 2048 tokens in all. Any
   unicode text round-trips; common English merges well, the rest falls back
   to bytes. The chat and tool markers are single tokens.
2. **Weights.** Random, from a fixed seed: the model is untrained and speaks
   gibberish. It exists for plumbing (shapes, masks, losses, generation,
   checkpointing), not for quality. Weights are bit-identical on every build.
3. **Chat template.** Qwen2.5's tool format (Qwen3's system turn), with no
   default system prompt and no rewriting of history (earlier `<think>` blocks
   are kept). It is prefix-stable at turn boundaries: rendering the first `i`
   messages gives a string prefix of rendering them all, and with
   `add_generation_prompt=True` too when message `i` is the assistant's. The one
   exception is Qwen's own: consecutive `tool` messages share one user turn, so
   a cut between two of them is not a prefix. (transformers refuses an empty
   conversation; rendered directly, one gives nothing, not even the tools
   system turn, unless a generation prompt is asked for.) Assistant turns are
   wrapped in `{% generation %}` so `return_assistant_tokens_mask=True` works.
4. **Cache.** One directory per build recipe (`tiny-v1-<fingerprint>`, the
   fingerprint covering corpus, template and hyper-parameters), built into a
   temporary sibling and renamed into place, so readers never see a partial
   build and concurrent builders cannot corrupt each other.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.resources
import json
import logging
import os
import pathlib
import shutil
import tempfile
import time
from typing import TYPE_CHECKING, Final

from . import tiny_vl
from ..runtime.fs import fsync_dir, fsync_tree
from ..errors import CheckpointError

if TYPE_CHECKING:  # torch and transformers load when a model is built or loaded, not with `import artrl`
    import torch
    from transformers import PreTrainedModel, PreTrainedTokenizerFast

logger = logging.getLogger(__name__)

# ---- names and on-disk layout -------------------------------------------------

TINY_MODEL_NAME: Final = "artrl/tiny"
"""The name `resolve_model_path` maps to the cached tiny model directory."""

TINY_VERSION: Final = "tiny-v1"
"""Bump when the build changes in a way the fingerprint does not see (e.g. the save format)."""

CACHE_DIR_ENV: Final = "ARTRL_CACHE_DIR"
DEFAULT_CACHE_DIR: Final = pathlib.Path("~/.cache/artrl")
BUILD_MARKER_FILE: Final = "artrl_build_complete.json"
"""Written last into a build directory; a directory without it is never used."""
CORPUS_FILE: Final = "tiny_corpus.txt"
_TMP_INFIX: Final = ".tmp-"
_STALE_TMP_AFTER_S: Final = 3600.0

# ---- tokens ---------------------------------------------------------------------

PAD_TOKEN: Final = "<|endoftext|>"
IM_START: Final = "<|im_start|>"
IM_END: Final = "<|im_end|>"
SPECIAL_TOKENS: Final = (PAD_TOKEN, IM_START, IM_END)
"""Added as special tokens (ids 0, 1, 2): never split, dropped by `skip_special_tokens`."""
MARKUP_TOKENS: Final = ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>")
"""Added as ordinary (non-special) single tokens, as Qwen does, so they survive decoding."""

# ---- build recipe -----------------------------------------------------------------

VOCAB_SIZE: Final = 2048
SEED: Final = 0
MAX_POSITIONS: Final = 8192
MODEL_SHAPE: Final = {
    "hidden_size": 128,
    "intermediate_size": 384,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    # ~1/sqrt(hidden_size): with transformers' default 0.02 the tied embeddings cap every logit near
    # +-2.5 behind the final RMSNorm, and LoRA (which cannot change the embeddings) then cannot fit
    # even four SFT examples (loss stalls at ~5.1 nats). At 0.1 the same LoRA fits them to ~0.01.
    "initializer_range": 0.1,
}

BENCH_MODEL_NAME: Final = "artrl/bench-100m"
BENCH_SHAPE: Final = {
    # ~76M non-embedding parameters: big enough that a CPU train step is bound by matmuls,
    # not Python overhead (performance benchmarks only; never trained to do anything).
    "hidden_size": 768,
    "intermediate_size": 2048,
    "num_hidden_layers": 12,
    "num_attention_heads": 12,
    "num_key_value_heads": 4,
    "head_dim": 64,
    "initializer_range": 0.02,
}
TINY_MOE_NAME: Final = "artrl/tiny-moe"
TINY_MOE_SHAPE: Final = {
    # the tiny model's attention and width with a Qwen3-MoE feed-forward: 8 experts of width 96, 2 per token
    # (renormalised top-k, as Qwen3-30B-A3B), in every layer; a 4-layer, 1.6M-parameter model, 0.7M of it active
    "model_type": "qwen3_moe",
    "hidden_size": 128,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "moe_intermediate_size": 96,
    "intermediate_size": 384,
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "norm_topk_prob": True,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "router_aux_loss_coef": 0.001,
    "initializer_range": 0.1,
}
BUILTIN_MODELS: Final = {TINY_MODEL_NAME: ("tiny-v1", MODEL_SHAPE), BENCH_MODEL_NAME: ("bench-100m-v1", BENCH_SHAPE),
                         TINY_MOE_NAME: ("tiny-moe-v1", TINY_MOE_SHAPE),
                         tiny_vl.TINY_VL_NAME: ("tiny-vl-v1", tiny_vl.TINY_VL_SHAPE)}
"""Built-in offline models: name -> (cache folder prefix, model shape; a shape's "model_type" names the
architecture, Qwen3 when absent). All share the tiny tokenizer; the vision-language one (tiny_vl.py) adds its
vision tokens, its chat template and its image processor."""
VISION_MODEL_TYPES: Final = ("qwen2_5_vl",)
WORKING_LEARNING_RATES: Final = {name: (1e-3, 1e-2, 5e-3) for name in (TINY_MODEL_NAME, TINY_MOE_NAME,
                                                                     tiny_vl.TINY_VL_NAME)}
"""Built-in model -> (low, high, a rate to start from) of the learning rates its LoRA learns at, RL and SFT alike
(docs/getting-started.md, "Choosing a learning rate": the examples and the demo train at 3e-3 to 1e-2). A
randomly initialised model of a million parameters needs about a thousand times a pretrained model's rate.
`artrl/bench-100m` has no entry: nothing measured says what it needs."""

CHAT_TEMPLATE: Final = """\
{%- macro render_content(content) -%}
    {%- if content is none or content is undefined -%}
    {%- elif content is string -%}
        {{- content -}}
    {%- else -%}
        {%- for part in content -%}
            {%- if part.type == 'text' -%}{{- part.text -}}{%- endif -%}
        {%- endfor -%}
    {%- endif -%}
{%- endmacro -%}
{%- set has_system = messages and messages[0].role == 'system' %}
{%- if tools %}
    {%- if messages or add_generation_prompt %}
        {{- '<|im_start|>system\\n' }}
        {%- if has_system %}
            {{- render_content(messages[0].content) + '\\n\\n' }}
        {%- endif %}
        {{- '# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n' }}
        {{- 'You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' }}
        {%- for tool in tools %}
            {{- '\\n' }}
            {{- tool | tojson }}
        {%- endfor %}
        {{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments ' }}
        {{- 'within <tool_call></tool_call> XML tags:\\n<tool_call>\\n' }}
        {{- '{"name": <function-name>, "arguments": <args-json-object>}\\n</tool_call><|im_end|>\\n' }}
    {%- endif %}
{%- elif has_system %}
    {{- '<|im_start|>system\\n' + render_content(messages[0].content) + '<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
    {%- if loop.first and message.role == 'system' %}
    {%- elif message.role == 'assistant' %}
        {{- '<|im_start|>assistant\\n' }}
        {%- generation %}
            {{- render_content(message.content) }}
            {%- if message.tool_calls %}
                {%- for tool_call in message.tool_calls %}
                    {%- if tool_call.function is defined %}
                        {%- set tool_call = tool_call.function %}
                    {%- endif %}
                    {%- if not loop.first or render_content(message.content) %}
                        {{- '\\n' }}
                    {%- endif %}
                    {{- '<tool_call>\\n{"name": "' + tool_call.name + '", "arguments": ' }}
                    {%- if tool_call.arguments is string %}
                        {{- tool_call.arguments }}
                    {%- else %}
                        {{- tool_call.arguments | tojson }}
                    {%- endif %}
                    {{- '}\\n</tool_call>' }}
                {%- endfor %}
            {%- endif %}
            {{- '<|im_end|>' }}
        {%- endgeneration %}
        {{- '\\n' }}
    {%- elif message.role == 'tool' %}
        {%- if loop.first or loop.previtem.role != 'tool' %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' + render_content(message.content) + '\\n</tool_response>' }}
        {%- if loop.last or loop.nextitem.role != 'tool' %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- else %}
        {{- '<|im_start|>' + message.role + '\\n' + render_content(message.content) + '<|im_end|>\\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}"""
"""Qwen2.5-style chat template with tools; see the module docstring for what it guarantees."""


def _corpus_text() -> str:
    return (importlib.resources.files("artrl") / "data" / CORPUS_FILE).read_text(encoding="utf-8")


@functools.cache
def build_fingerprint(name: str = TINY_MODEL_NAME) -> str:
    """A short hash of everything the build depends on: corpus, template, tokens, shape, seed."""
    version, shape = BUILTIN_MODELS[name]
    recipe = {
        "version": version,
        "corpus_sha256": hashlib.sha256(_corpus_text().encode("utf-8")).hexdigest(),
        "chat_template": CHAT_TEMPLATE,
        "special": SPECIAL_TOKENS,
        "markup": MARKUP_TOKENS,
        "vocab_size": VOCAB_SIZE,
        "seed": SEED,
        "max_positions": MAX_POSITIONS,
        "shape": shape,
    }
    if _is_vision(name):
        recipe.update(tiny_vl.recipe(), chat_template=tiny_vl.chat_template(CHAT_TEMPLATE))
    return hashlib.sha256(json.dumps(recipe, sort_keys=True).encode("utf-8")).hexdigest()[:12]


def _is_vision(name: str) -> bool:
    return BUILTIN_MODELS[name][1].get("model_type") in VISION_MODEL_TYPES


def build_tiny_tokenizer(vision: bool = False) -> PreTrainedTokenizerFast:
    """Train the byte-level BPE on the shipped corpus and wrap it for transformers (deterministic); `vision`:
    with the vision tokens and chat template of `artrl/tiny-vl` (tiny_vl.py)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE - len(MARKUP_TOKENS),  # the trainer's vocabulary includes the special tokens
        min_frequency=1,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    lines = _corpus_text().splitlines(keepends=True)
    backend.train_from_iterator(lines, trainer=trainer, length=len(lines))
    backend.add_tokens([AddedToken(t, special=False, normalized=False) for t in MARKUP_TOKENS])
    if backend.get_vocab_size() != VOCAB_SIZE:
        raise CheckpointError(
            f"The tiny tokenizer has {backend.get_vocab_size()} tokens, expected {VOCAB_SIZE}; "
            f"the corpus data/{CORPUS_FILE} is too small for that many merges. Add text to it or lower VOCAB_SIZE."
        )
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        eos_token=IM_END,
        pad_token=PAD_TOKEN,
        bos_token=None,
        unk_token=None,
        model_max_length=MAX_POSITIONS,
        clean_up_tokenization_spaces=False,  # exact round-trips
        chat_template=tiny_vl.chat_template(CHAT_TEMPLATE) if vision else CHAT_TEMPLATE,
    )
    if vision:
        tiny_vl.add_vision_tokens(tokenizer)
    return tokenizer


_ARCHITECTURES: Final = {"qwen3": ("Qwen3Config", "Qwen3ForCausalLM"), "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM")}
"""A built-in shape's "model_type" -> transformers' config and model classes (imported when a model is built)."""


def build_tiny_model(tokenizer: PreTrainedTokenizerFast, shape: dict | None = None) -> PreTrainedModel:
    """A randomly initialised Qwen3 (or, by the shape's "model_type", Qwen3-MoE or Qwen2.5-VL) LM sized for
    `tokenizer`; bit-identical weights on every call."""
    import torch
    import transformers
    from transformers import GenerationConfig

    eos_id = tokenizer.convert_tokens_to_ids(IM_END)
    pad_id = tokenizer.convert_tokens_to_ids(PAD_TOKEN)
    shape = dict(shape if shape is not None else MODEL_SHAPE)
    if shape.get("model_type") in VISION_MODEL_TYPES:
        model = tiny_vl.build_model(tokenizer, shape, max_positions=MAX_POSITIONS, eos_id=eos_id, pad_id=pad_id,
                                    seed=SEED)
        model.generation_config = GenerationConfig(bos_token_id=None, eos_token_id=eos_id, pad_token_id=pad_id)
        return model.eval()
    model_type = shape.pop("model_type", "qwen3")
    config_name, model_name = _ARCHITECTURES[model_type]
    config_class, model_class = getattr(transformers, config_name), getattr(transformers, model_name)
    config = config_class(
        vocab_size=len(tokenizer),
        max_position_embeddings=MAX_POSITIONS,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=eos_id,
        pad_token_id=pad_id,
        dtype=torch.float32,
        attn_implementation="sdpa",
        **shape,
    )
    # Seed a private copy of the CPU generator so the caller's random stream is untouched.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(SEED)
        model = model_class(config)
    model.generation_config = GenerationConfig(bos_token_id=None, eos_token_id=eos_id, pad_token_id=pad_id)
    return model.eval()


def _cache_root(cache_dir: str | os.PathLike[str] | None) -> pathlib.Path:
    if cache_dir is None:
        cache_dir = os.environ.get(CACHE_DIR_ENV) or DEFAULT_CACHE_DIR
    return pathlib.Path(cache_dir).expanduser().resolve()


def _is_complete(path: pathlib.Path) -> bool:
    return (path / BUILD_MARKER_FILE).is_file()


def _remove_stale_tmp_dirs(root: pathlib.Path) -> None:
    """Delete temporary build dirs that a crashed process left behind (older than an hour)."""
    now = time.time()
    stale = [p for version, _ in BUILTIN_MODELS.values() for p in root.glob(f".{version}-*{_TMP_INFIX}*")]
    for path in stale:
        try:
            if now - path.stat().st_mtime > _STALE_TMP_AFTER_S:
                shutil.rmtree(path, ignore_errors=True)
        except OSError:
            pass  # another process removed it first


def _build_into(directory: pathlib.Path, name: str = TINY_MODEL_NAME) -> None:
    from ..runtime.progress import hf_bars_off_in_a_log

    version, shape = BUILTIN_MODELS[name]
    tokenizer = build_tiny_tokenizer(vision=_is_vision(name))
    model = build_tiny_model(tokenizer, shape)
    with hf_bars_off_in_a_log():  # "Writing model shards" would be a line of carriage returns in a log
        model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    if _is_vision(name):
        tiny_vl.build_image_processor().save_pretrained(directory)
    if not (directory / "config.json").is_file() or not any(directory.glob("*.safetensors")):
        # transformers' save_pretrained writes nothing on ranks > 0 once torch.distributed is initialised
        raise CheckpointError(
            f"building {name}: transformers wrote no model files into {directory} (it writes only on rank 0 of an "
            "initialised torch.distributed process group). Build it before init_process_group, e.g. call "
            "artrl.models.tiny.tiny_model_path() first.")
    fsync_tree(directory)
    marker = {"version": version, "fingerprint": build_fingerprint(name)}
    (directory / BUILD_MARKER_FILE).write_text(json.dumps(marker, indent=2) + "\n", encoding="utf-8")
    fsync_tree(directory)


def tiny_model_path(cache_dir: str | os.PathLike[str] | None = None, name: str = TINY_MODEL_NAME) -> pathlib.Path:
    """The directory of a built-in model (weights, config, tokenizer), building it on first use.

    `name` is one of BUILTIN_MODELS ("artrl/tiny" by default, "artrl/bench-100m", "artrl/tiny-moe",
    "artrl/tiny-vl").
    `cache_dir` defaults to `$ARTRL_CACHE_DIR`, else `~/.cache/artrl`. Safe to call
    from many processes at once: each builds into its own temporary directory and
    the first to rename it into place wins; the others discard theirs.
    """
    root = _cache_root(cache_dir)
    if name not in BUILTIN_MODELS:
        raise ValueError(f"{name!r} is not a built-in model; known: {sorted(BUILTIN_MODELS)}")
    final = root / f"{BUILTIN_MODELS[name][0]}-{build_fingerprint(name)}"
    if _is_complete(final):
        return final
    root.mkdir(parents=True, exist_ok=True)
    _remove_stale_tmp_dirs(root)
    started = time.perf_counter()
    logger.info("Building %s into %s (first use of this cache dir).", name, final)
    tmp = pathlib.Path(tempfile.mkdtemp(prefix=f".{final.name}{_TMP_INFIX}", dir=root))
    try:
        tmp.chmod(0o755)  # mkdtemp makes it private; the cache may be shared
        _build_into(tmp, name)
        try:
            os.rename(tmp, final)  # atomic; fails if `final` exists and is not empty
        except OSError as err:
            if _is_complete(final):
                logger.info("Another process finished %s first; discarding this build.", final)
            else:
                raise CheckpointError(
                    f"Cannot publish the tiny model at {final}: that path exists but holds no {BUILD_MARKER_FILE}, "
                    f"so it is not a finished artrl build ({err}). Delete {final} and retry."
                ) from err
        else:
            fsync_dir(root)
            logger.info("Built the tiny model in %.1f s.", time.perf_counter() - started)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return final


def resolve_model_path(name_or_path: str) -> str:
    """Map a built-in name ("artrl/tiny", "artrl/bench-100m") to its cached directory; return anything else unchanged."""
    if name_or_path in BUILTIN_MODELS:
        return str(tiny_model_path(name=name_or_path))
    return name_or_path


def load_tiny(
    cache_dir: str | os.PathLike[str] | None = None, dtype: torch.dtype | None = None
) -> tuple[PreTrainedModel, PreTrainedTokenizerFast]:
    """Load (building if needed) the tiny model and its tokenizer from the cache (`dtype`: float32 unless given)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast

    dtype = torch.float32 if dtype is None else dtype
    path = tiny_model_path(cache_dir)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    tokenizer = AutoTokenizer.from_pretrained(path)
    if not isinstance(tokenizer, PreTrainedTokenizerFast):
        raise CheckpointError(
            f"The tokenizer in {path} loaded as {type(tokenizer).__name__}, not a fast tokenizer; "
            f"the cache is damaged. Delete {path} and retry."
        )
    return model, tokenizer
