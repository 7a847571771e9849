"""Quantised base weights (models/quantization.py), random shapes built a tensor at a time (models/random_init.py)
and ART's optimizers (train/optimizers.py)."""

from __future__ import annotations

import pytest
import torch

import artrl as art
from artrl.models import quantization
from artrl.models.loading import load_model, parameter_count
from artrl.models.quantization import resolve_quantization
from artrl.models.random_init import build_random_model
from artrl.models.shapes import RANDOM_SHAPES, random_config
from artrl.train import optimizers
from artrl.config.optimizers import SUPPORTED_OPTIMS, optim_spec
from artrl.train.optimizers import build_optimizer, load_state, moments, set_moments

CPU = torch.device("cpu")


def _cfg(**kw) -> art.InternalModelConfig:
    return art.InternalModelConfig(**kw)


def test_arts_default_is_4bit_for_hugging_face_checkpoints_and_full_precision_for_artrls_own(tiny_path, tmp_path):
    assert resolve_quantization(_cfg(), "Qwen/Qwen3-8B", "cuda") == "4bit"
    assert resolve_quantization(_cfg(), str(tmp_path), "cuda") == "4bit"  # a local directory artrl did not build
    # a CPU's default is full precision; settle_quantization turns it to 4-bit where the plan says it must
    assert resolve_quantization(_cfg(), "Qwen/Qwen3-8B", "cpu") is None
    assert resolve_quantization(_cfg(), str(tmp_path), "cpu") is None
    for own in ("artrl/tiny", str(tiny_path), *RANDOM_SHAPES):
        assert resolve_quantization(_cfg(), own, "cpu") is None, own
    assert resolve_quantization(_cfg(load_in_4bit=False), "Qwen/Qwen3-8B", "cuda") is None
    assert resolve_quantization(_cfg(load_in_4bit=True), "artrl/tiny", "cpu") == "4bit"
    assert resolve_quantization(_cfg(load_in_8bit=True), "Qwen/Qwen3-8B", "cpu") == "8bit"


@pytest.mark.parametrize(("config", "device", "says"), [
    ({"load_in_4bit": True, "load_in_8bit": True}, "cpu", "choose one"),
    ({"load_in_4bit": True}, "mps", "bitsandbytes quantises on"),
])
def test_quantisations_that_cannot_load_are_refused_with_the_way_out(config, device, says):
    with pytest.raises(art.ConfigError, match=says) as e:
        resolve_quantization(art.InternalModelConfig.model_construct(**{**_cfg().model_dump(), **config}),
                             "artrl/tiny", device)
    assert "load_in_4bit" in str(e.value)


def test_both_bit_widths_and_unknown_optimizers_are_refused_at_register_time():
    with pytest.raises(art.ConfigError, match="choose one"):
        _cfg(load_in_4bit=True, load_in_8bit=True).check()
    with pytest.raises(art.ConfigError, match="optim='adamw_apex_fused' is not supported.*paged_adamw_8bit"):
        _cfg(optim="adamw_apex_fused").check()
    _cfg(optim="paged_adamw_8bit").check()


def test_without_bitsandbytes_quantisation_and_8bit_optimizers_say_how_to_install_it(monkeypatch):
    import artrl.config.optimizers

    monkeypatch.setattr(quantization, "bitsandbytes_installed", lambda: False)
    monkeypatch.setattr(artrl.config.optimizers, "bitsandbytes_installed", lambda: False)
    with pytest.raises(art.ConfigError, match="default for a Hugging Face model.*pip install bitsandbytes.*"
                                              "load_in_4bit=False"):
        resolve_quantization(_cfg(), "Qwen/Qwen3-8B", "cuda")
    with pytest.raises(art.ConfigError, match="optim='adamw_8bit' needs bitsandbytes.*optim='adamw_torch'"):
        _cfg(optim="adamw_8bit").check()
    assert resolve_quantization(_cfg(), "artrl/tiny", "cpu") is None  # full precision needs nothing


@pytest.mark.parametrize("bits", ["4bit", "8bit"])
def test_quantised_tiny_model_trains_its_adapter_and_shares_nothing_with_full_precision(tiny_path, bits):
    cfg = _cfg(dtype="float32", **({"load_in_4bit": True} if bits == "4bit" else {"load_in_8bit": True}))
    model, tok = load_model(str(tiny_path), cfg)
    assert quantization.quantization_of(model) == bits
    layers = quantization.quantized_modules(model)
    assert len(layers) == 4 * 7  # every projection of the 4 decoder layers; the embedding stays float
    assert model.get_input_embeddings().weight.dtype == torch.float32
    # the 4-bit weights pack two in a byte; the parameter count is the model's own
    full, _ = load_model(str(tiny_path), _cfg())
    assert parameter_count(model) == parameter_count(full)
    ids = torch.tensor([tok("Name a colour.").input_ids])
    logits = model(input_ids=ids).logits  # [1, seq, vocab]
    logits.float().logsumexp(-1).sum().backward()
    lora = [p for n, p in model.named_parameters() if "lora_A" in n]
    assert lora and all(p.grad is not None for p in lora)
    assert all(not p.requires_grad for _, m in layers for p in m.parameters(recurse=False))


def test_no_4bit_layer_repacks_its_weight_for_the_bf16_inference_kernel(tiny_path):
    # bitsandbytes repacks an eval-mode 4-bit layer's weight in place on AVX512-BF16 CPUs (models/quantization.py)
    model, tok = load_model(str(tiny_path), _cfg(load_in_4bit=True, dtype="float32"))
    model.eval()
    with torch.no_grad():
        model(input_ids=torch.tensor([[5, 6, 7]]))
    for _, layer in quantization.quantized_modules(model):
        assert not getattr(layer.weight.quant_state, "packing_format_for_cpu", False)


def _small_shape(**overrides):
    fields = dict(num_hidden_layers=2, hidden_size=256, intermediate_size=512, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=64, vocab_size=1024)
    return random_config("random:qwen3-0.6b", **{**fields, **overrides})


def test_a_random_shape_is_the_same_model_in_every_dtype_and_its_4bit_weights_quantise_its_own():
    config = _small_shape()
    a = build_random_model(config, device=CPU, dtype=torch.float32, attn_implementation="sdpa", seed=3)
    b = build_random_model(config, device=CPU, dtype=torch.float32, attn_implementation="sdpa", seed=3)
    half = build_random_model(config, device=CPU, dtype=torch.bfloat16, attn_implementation="sdpa", seed=3)
    other = build_random_model(config, device=CPU, dtype=torch.float32, attn_implementation="sdpa", seed=4)
    four = build_random_model(config, device=CPU, dtype=torch.float32, attn_implementation="sdpa", seed=3,
                              quantization="4bit")
    for name, p in a.named_parameters():
        assert torch.equal(p, b.get_parameter(name)), name
        torch.testing.assert_close(half.get_parameter(name).float(), p, rtol=1e-2, atol=1e-3)
    assert not torch.equal(a.model.embed_tokens.weight, other.model.embed_tokens.weight)
    assert a.lm_head.weight is a.model.embed_tokens.weight  # tied, as Qwen3-0.6B
    assert a.model.layers[0].input_layernorm.weight.eq(1).all()
    assert a.model.layers[0].self_attn.q_proj.weight.std().item() == pytest.approx(0.02, rel=0.05)
    # a layer cut from the build keeps the weights of the layers it keeps
    one = build_random_model(_small_shape(num_hidden_layers=1), device=CPU, dtype=torch.float32,
                             attn_implementation="sdpa", seed=3)
    assert torch.equal(one.model.layers[0].mlp.up_proj.weight, a.model.layers[0].mlp.up_proj.weight)
    # the 4-bit build holds bitsandbytes' quantisation of these very weights
    bnb = quantization.import_bitsandbytes()
    want = bnb.nn.Params4bit(a.model.layers[1].mlp.down_proj.weight.detach().clone(), requires_grad=False,
                             quant_type="nf4", compress_statistics=True).to("cpu")
    got = four.model.layers[1].mlp.down_proj.weight
    assert isinstance(got, bnb.nn.Params4bit) and torch.equal(got.data, want.data)
    ids = torch.tensor([[1, 2, 3, 4]])
    with torch.no_grad():
        assert torch.isfinite(four(ids).logits).all() and torch.equal(a(ids).logits, b(ids).logits)


def test_every_random_shape_has_its_published_size():
    sizes = {name: sum(p.numel() for p in _meta(name).parameters()) / 1e9 for name in RANDOM_SHAPES}
    # Qwen3's model cards: 0.6B, 4.0B, 8.2B, 14.8B, 32.8B parameters
    for name, billions in {"random:qwen3-0.6b": 0.6, "random:qwen3-4b": 4.0, "random:qwen3-8b": 8.2,
                           "random:qwen3-14b": 14.8, "random:qwen3-32b": 32.8}.items():
        assert sizes[name] == pytest.approx(billions, rel=0.03), name


def _meta(name: str):
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(random_config(name))


# ----------------------------------------------------------------------------------------------- optimizers

def _stepped(spec_name: str, steps: int = 4):
    gen = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(32, 128, generator=gen) * 0.1),  # 4096: 8-bit moments
              torch.nn.Parameter(torch.randn(16, 64, generator=gen) * 0.1)]   # 1024: float32 moments
    opt, _ = build_optimizer(params, optim_spec(spec_name), fused=False)
    for i in range(steps):
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen) * 0.01 * (i + 1)
        opt.step()
    return params, opt


@pytest.mark.parametrize("name", SUPPORTED_OPTIMS)
def test_every_arts_optimizer_name_steps(name):
    if name == "adamw_torch_fused" and not hasattr(torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], fused=True),
                                                   "step"):
        pytest.skip("no fused AdamW")
    params, opt = _stepped(name)
    spec = optim_spec(name)
    assert optimizers.is_bnb(opt) == spec.bnb
    state = opt.state[params[0]]
    if spec.bits == 8:
        assert state["state1"].dtype == torch.uint8 and opt.state[params[1]]["state1"].dtype == torch.float32


@pytest.mark.parametrize(("written", "read"), [("adamw_torch", "adamw_8bit"), ("adamw_8bit", "adamw_torch"),
                                               ("paged_adamw_8bit", "paged_adamw_32bit")])
def test_a_checkpoint_of_one_optimizer_resumes_in_another(written, read):
    params, opt = _stepped(written)
    want = moments(opt)
    copies = [torch.nn.Parameter(p.detach().clone()) for p in params]
    other, _ = build_optimizer(copies, optim_spec(read), fused=False)
    load_state(other, opt.state_dict(), written, optim_spec(read))
    got = moments(other)
    assert got.keys() == want.keys()
    for i in want:
        assert got[i]["step"] == want[i]["step"] == 4
        # 8-bit storage on either side: within its quantisation error; float32 on both: the same numbers
        tol = 0.05 if "8bit" in read or "8bit" in written else 0.0
        for key in ("exp_avg", "exp_avg_sq"):
            scale = want[i][key].abs().max()
            assert float((got[i][key] - want[i][key]).abs().max()) <= tol * float(scale), (i, key)


def test_8bit_moments_quantise_again_to_the_same_bytes_but_where_a_blocks_largest_is_negative():
    params, opt = _stepped("adamw_8bit")
    copies = [torch.nn.Parameter(p.detach().clone()) for p in params]
    again, _ = build_optimizer(copies, optim_spec("adamw_8bit"), fused=False)
    set_moments(again, moments(opt))
    a, b = opt.state[params[0]], again.state[copies[0]]
    assert torch.equal(a["state2"], b["state2"]) and torch.equal(a["absmax2"], b["absmax2"])  # unsigned map
    m = moments(opt)[0]["exp_avg"].flatten().view(-1, optimizers.BLOCKSIZE)  # [blocks, 256]
    negative_max = m.gather(1, m.abs().argmax(1, keepdim=True)).squeeze(1) < 0  # [blocks]
    same = a["absmax1"] == b["absmax1"]  # [blocks]
    assert torch.equal(same, ~negative_max)  # exactly the blocks whose largest moment is negative differ


def _hf_checkpoint(tiny_path, tmp_path):
    """The tiny model as a directory artrl did not build: a Hugging Face checkpoint to the loader."""
    import shutil

    from artrl.models.tiny import BUILD_MARKER_FILE

    local = tmp_path / "checkpoint"
    shutil.copytree(tiny_path, local, ignore=shutil.ignore_patterns(BUILD_MARKER_FILE))
    return local


def test_a_local_checkpoint_loads_in_full_precision_on_a_cpu_where_it_fits(tiny_path, tmp_path, caplog):
    """On a CPU a Hugging Face checkpoint loads in float32 by default when the plan says it fits (4-bit there is
    slower and its sampler/trainer agreement 1e-2, not 1e-5); `load_in_4bit=True` still quantises it."""
    local = _hf_checkpoint(tiny_path, tmp_path)
    model, _ = load_model(str(local), _cfg())
    assert quantization.quantization_of(model) is None
    assert next(model.parameters()).dtype == torch.float32
    model, _ = load_model(str(local), _cfg(load_in_4bit=True, dtype="float32"))
    assert quantization.quantization_of(model) == "4bit"


def test_a_local_checkpoint_too_big_for_a_cpu_in_full_precision_loads_in_4bit_and_says_so(tiny_path, tmp_path,
                                                                                         monkeypatch, caplog):
    """Where the plan says float32 will not fit the host, the default is 4-bit, with the figures at INFO; a
    user's load_in_4bit=False is kept (and then refused by the plan, with the settings that fit)."""
    import logging

    from artrl.models import loading, memory_plan

    local = _hf_checkpoint(tiny_path, tmp_path)
    full = memory_plan.plan_for(str(local), _cfg(load_in_4bit=False), CPU)
    four = memory_plan.plan_for(str(local), _cfg(load_in_4bit=True), CPU)
    assert four.peak < full.peak
    room = (four.peak + full.peak) // 2  # room for the 4-bit plan, not the float32 one
    monkeypatch.setattr(memory_plan, "available_bytes", lambda *a, **k: room)
    with caplog.at_level(logging.INFO, logger="artrl.models.resolved"):
        settled = loading.settle_quantization(str(local), _cfg(), CPU)
        model, _ = load_model(str(local), _cfg())
    assert settled.load_in_4bit is True and quantization.quantization_of(model) == "4bit"
    assert "full precision would need" in caplog.text and "loads in 4-bit" in caplog.text
    assert loading.settle_quantization(str(local), _cfg(load_in_4bit=False), CPU).load_in_4bit is False
    with pytest.raises(art.ConfigError, match="does not fit"):
        load_model(str(local), _cfg(load_in_4bit=False))
    # artrl's own models and a GPU keep their defaults whatever the plan says
    assert loading.settle_quantization(str(tiny_path), _cfg(), CPU).load_in_4bit is None
    assert loading.settle_quantization(str(local), _cfg(), torch.device("cuda")).load_in_4bit is None


def test_a_registered_local_checkpoint_trains_and_serves_full_precision_on_a_cpu(tiny_path, tmp_path):
    """Through the public API: the trainer and the engine of a directory model hold the same float32 weights."""
    import asyncio

    local = _hf_checkpoint(tiny_path, tmp_path)

    async def main():
        backend = art.LocalBackend(path=str(tmp_path / "runs"), show_progress=False)
        model = art.TrainableModel(name="hf", project="p", base_model=str(local))
        await model.register(backend)
        session = backend._runs[model.name]
        try:
            return (quantization.quantization_of(session.trainer.model),
                    quantization.quantization_of(session.engine._model))
        finally:
            await backend.close()

    assert asyncio.run(main()) == (None, None)
