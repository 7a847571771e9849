"""Images in messages and the tiny vision-language model: loading under the media policy, the server's answers,
tokenization and packing of image-bearing data, positions, and every bad input as a clear error.

The end-to-end properties (a multi-turn image rollout trains on its exact record; the same groups give the same
update whatever the layout) run on the "vision" kind of tests/model_kinds.py in test_token_record.py and
test_steps.py.
"""

from __future__ import annotations

import base64
import hashlib
import http.server
import io
import os
import re
import socket
import threading
from collections.abc import Iterator
from typing import Any

import openai
import pytest
import torch
from PIL import Image

import artrl as art
from artrl.errors import ConfigError, ImageError
from artrl.chat.images import (DEFAULT_ALLOWED_LOCAL_MEDIA_PATH, DEFAULT_MAX_IMAGE_BYTES, DEFAULT_MAX_IMAGE_PIXELS,
                          MediaPolicy, load_image)
from artrl.models.loading import add_lora, load_base_model, load_vision
from artrl.models.vision import VisionInputs
from artrl.preprocess.pack import _truncate, pack
from artrl.trajectories.tokenization import tokenize_groups, tokenize_sft
from artrl.serve.http.served_models import ServedModels
from artrl.serve.http.server import create_app, start_server
from artrl.serve.engines.transformers_engine import TransformersEngine
from artrl.models.tiny import load_tiny

from model_kinds import COLOURS, image_url, vision_content


def encoded(image: Image.Image, fmt: str) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format=fmt)
    return buffer.getvalue()


def data_url_of(data: bytes, media: str = "image/png") -> str:
    return f"data:{media};base64,{base64.b64encode(data).decode()}"


def noisy(size: tuple[int, int]) -> Image.Image:
    """An image that does not compress (for byte limits)."""
    return Image.frombytes("RGB", size, os.urandom(size[0] * size[1] * 3))


# ---------------------------------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def media_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(tmp_path_factory.mktemp("media"))


@pytest.fixture(scope="module")
def vl(media_dir: str) -> tuple[Any, Any, VisionInputs]:
    cfg = art.InternalModelConfig(allowed_local_media_path=media_dir, max_image_pixels=200 * 200,
                                  max_image_bytes=50_000, fetch_image_urls=False)
    model, tok = load_base_model("artrl/tiny-vl", cfg)
    vision = load_vision("artrl/tiny-vl", tok, model.config, cfg)
    assert vision is not None
    return model, tok, vision


@pytest.fixture(scope="module")
def client(vl: tuple[Any, Any, VisionInputs]) -> Iterator[openai.OpenAI]:
    model, tok, vision = vl
    engine = TransformersEngine(model, tok, vision=vision)
    text_model, text_tok = load_tiny()
    text_engine = TransformersEngine(text_model, text_tok)
    models = ServedModels("vl", engine)
    models.add("text", text_engine)
    handle = start_server(create_app(models))
    yield openai.OpenAI(base_url=handle.base_url, api_key="x", max_retries=0, timeout=120)
    handle.stop()
    engine.close()
    text_engine.close()


class _Images(http.server.BaseHTTPRequestHandler):
    """Serves /red.png, and /big.png of more bytes than a test policy takes."""

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        body = {"/red.png": encoded(Image.new("RGB", (56, 56), COLOURS["red"]), "PNG"),
                "/big.png": encoded(noisy((64, 64)), "PNG")}.get(self.path)
        if body is None:
            self.send_error(404)
            return
        self.send_response(200)
        self.send_header("Content-Type", "image/png")
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture(scope="module")
def http_images() -> Iterator[str]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Images)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    thread.join(10)


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---------------------------------------------------------------------------------------------------- the model


def test_tiny_vl_is_a_qwen25_vl_whose_adapter_leaves_the_vision_tower_frozen(vl):
    model, tok, vision = vl
    assert type(model).__name__ == "Qwen2_5_VLForConditionalGeneration"
    vision_params = sum(p.numel() for p in model.model.visual.parameters())
    assert 0 < vision_params < sum(p.numel() for p in model.model.language_model.parameters())
    assert type(vision.processor).__name__ == "Qwen2VLImageProcessorPil"
    peft = add_lora(load_base_model("artrl/tiny-vl")[0], art.InternalModelConfig())
    adapted = {n.split(".lora_A")[0] for n, _ in peft.named_parameters() if ".lora_A" in n}
    assert adapted and all(".language_model." in n for n in adapted)
    # ART's seven projection names, matched in the language model only: the vision MLP has gate/up/down_proj too
    assert {n.rsplit(".", 1)[-1] for n in adapted} == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                       "up_proj", "down_proj"}
    assert not any(p.requires_grad for p in peft.get_base_model().model.visual.parameters())


def test_the_chat_template_shows_images_of_user_system_and_tool_messages(vl):
    _, tok, _ = vl
    image = {"type": "image"}
    text = tok.apply_chat_template([
        {"role": "system", "content": [{"type": "text", "text": "S"}, image]},
        {"role": "user", "content": [image, {"type": "text", "text": "U"}]},
        {"role": "assistant", "content": "A"},
        {"role": "tool", "content": [{"type": "text", "text": "T"}, image]},
    ], tokenize=False)
    assert text.count("<|vision_start|><|image_pad|><|vision_end|>") == 3
    assert "S<|vision_start|>" in text and "<|vision_end|>U" in text and "T<|vision_start|>" in text


@pytest.mark.parametrize("sizes", [[], [(56, 56)], [(112, 56), (56, 84)], [(84, 84), (224, 56), (56, 56)]],
                         ids=["text", "one", "two", "three"])
def test_positions_are_the_models_own_rope_index(vl, sizes):
    """`VisionInputs.positions` (what the packer places) equals the model's `get_rope_index` for one sequence."""
    model, tok, vision = vl
    images = [vision.process(load_image(image_url("red", size), vision.policy, "x")) for size in sizes]
    ids = tok("Hi there. ", add_special_tokens=False).input_ids
    for k, image in enumerate(images):  # text, an image (two in a row at the end), text
        ids += [tok.convert_tokens_to_ids("<|vision_start|>")] + [vision.image_token_id] * image.tokens
        ids += [tok.convert_tokens_to_ids("<|vision_end|>")]
        if k != len(images) - 2:
            ids += tok(f" and {k} more words", add_special_tokens=False).input_ids
    ids_t = torch.tensor([ids])
    types = (ids_t == vision.image_token_id).int()
    grid = torch.tensor([i.grid for i in images]) if images else None
    if images:
        want, _ = model.model.get_rope_index(ids_t, types, image_grid_thw=grid)
    else:
        want = torch.arange(len(ids))[None, None].expand(3, 1, -1)
    spans = list(zip(vision.spans(ids, images, "x"), images))
    assert torch.equal(vision.positions(len(ids), spans), want[:, 0])


# ---------------------------------------------------------------------------------------------------- loading


@pytest.mark.parametrize("fmt", ["PNG", "JPEG", "WEBP"])
def test_png_jpeg_and_webp_data_urls_load_with_the_hash_of_their_bytes(fmt):
    data = encoded(Image.new("RGBA" if fmt == "PNG" else "RGB", (30, 20), (10, 200, 30)), fmt)
    loaded = load_image(data_url_of(data, f"image/{fmt.lower()}"), MediaPolicy(), "m")
    assert loaded.digest == hashlib.sha256(data).hexdigest()
    assert loaded.image.mode == "RGB" and loaded.image.size == (30, 20)


def test_the_limits_defaults_are_documented_and_are_the_configs():
    cfg = art.InternalModelConfig()
    assert MediaPolicy.of(cfg) == MediaPolicy()
    assert (DEFAULT_ALLOWED_LOCAL_MEDIA_PATH, DEFAULT_MAX_IMAGE_BYTES, DEFAULT_MAX_IMAGE_PIXELS) == (
        "/tmp", 20 * 1024 * 1024, 4096 * 4096)  # ART's path; OpenAI's byte limit; 16.8M pixels
    nested = art.InternalModelConfig(**{"engine_args": {"allowed_local_media_path": "/data/images"}})
    assert nested.allowed_local_media_path == "/data/images"  # ART's name


def test_file_urls_load_under_the_allowed_directory_only(media_dir, tmp_path):
    inside = os.path.join(media_dir, "blue.png")
    Image.new("RGB", (8, 8), COLOURS["blue"]).save(inside)
    policy = MediaPolicy(allowed_local_media_path=media_dir)
    assert load_image(f"file://{inside}", policy, "m").image.size == (8, 8)
    outside = tmp_path / "secret.png"
    Image.new("RGB", (8, 8)).save(outside)
    link = os.path.join(media_dir, "link.png")
    if not os.path.exists(link):
        os.symlink(outside, link)
    for url in (f"file://{outside}", f"file://{link}", f"file://{media_dir}/../{outside.name}"):
        with pytest.raises(ImageError, match=r"^m: .* is outside allowed_local_media_path"):
            load_image(url, policy, "m")
    with pytest.raises(ImageError, match="allowed_local_media_path is not set"):
        load_image(f"file://{inside}", MediaPolicy(allowed_local_media_path=None), "m")


def test_http_urls_are_fetched_within_limits_or_refused_with_the_way_out(http_images):
    on = MediaPolicy(image_fetch_timeout_s=5.0, max_image_bytes=4000)
    assert load_image(f"{http_images}/red.png", on, "m").image.getpixel((0, 0)) == COLOURS["red"]
    with pytest.raises(ImageError, match="more than max_image_bytes=4000"):
        load_image(f"{http_images}/big.png", on, "m")
    with pytest.raises(ImageError, match="answered HTTP 404"):
        load_image(f"{http_images}/none.png", on, "m")
    with pytest.raises(ImageError, match=r"could not fetch .* may be offline .* data: URL"):
        load_image(f"http://127.0.0.1:{closed_port()}/red.png", on, "m")
    with pytest.raises(ImageError, match=r"fetching image URLs is off \(fetch_image_urls=False\)"):
        load_image(f"{http_images}/red.png", MediaPolicy(fetch_image_urls=False), "m")


BAD_IMAGES = {
    "not an image": (lambda d: data_url_of(b"hello, not an image"), "does not decode"),
    "truncated": (lambda d: data_url_of(encoded(noisy((40, 40)), "PNG")[:300]), "does not decode"),
    "gif": (lambda d: data_url_of(encoded(Image.new("RGB", (8, 8)), "GIF")), "the image is GIF"),
    "not base64": (lambda d: "data:image/png;base64,@@@", "base64 does not decode"),
    "not an image type": (lambda d: "data:text/plain;base64,aGk=", "is not 'data:image/<png|jpeg|webp>;base64"),
    "too many pixels": (lambda d: image_url("red", (300, 300)), r"300 x 300 = 90000 pixels, more than max_image_pixels"),
    "too many bytes": (lambda d: data_url_of(encoded(noisy((150, 150)), "PNG")), "more than max_image_bytes"),
    "outside the directory": (lambda d: "file:///etc/hostname", "outside allowed_local_media_path"),
    "http, fetching off": (lambda d: "https://example.com/cat.png", "fetching image URLs is off"),
}


@pytest.mark.parametrize("name", sorted(BAD_IMAGES))
def test_the_server_answers_each_bad_image_with_a_400_naming_the_part(client, media_dir, name):
    """The server's policy (the `vl` fixture): files under `media_dir`, 200 x 200 pixels, 50,000 bytes, no fetching."""
    url, fragment = BAD_IMAGES[name]
    messages = [{"role": "user", "content": [{"type": "text", "text": "What colour?"},
                                             {"type": "image_url", "image_url": {"url": url(media_dir)}}]}]
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model="vl", messages=messages, max_tokens=2)
    error = caught.value.body
    assert caught.value.status_code == 400 and error["param"] == "messages[0].content[1]", error
    assert error["message"].startswith("messages[0].content[1]"), error["message"]
    assert re.search(fragment, error["message"]), error["message"]


def test_a_model_without_a_vision_tower_refuses_an_image_with_a_400(client):
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model="text", messages=[{"role": "user", "content": vision_content("Hi", "red")}],
                                       max_tokens=2)
    assert caught.value.body["param"] == "messages[0].content[1]"
    assert "has no vision tower" in caught.value.body["message"]


# ---------------------------------------------------------------------------------------------------- serving


def test_a_served_image_is_expanded_and_recorded_by_hash_and_grid(client, vl):
    _, tok, vision = vl
    url = image_url("green", (56, 112))
    data = base64.b64decode(url.split(",", 1)[1])
    messages = [{"role": "user", "content": vision_content("What colour is this?", "green", (56, 112))},
                {"role": "assistant", "content": "Green."},
                {"role": "tool", "content": [{"type": "text", "text": "And this one?"},
                                             {"type": "image_url", "image_url": {"url": url}}]}]
    response = client.chat.completions.create(model="vl", messages=messages, max_tokens=4, seed=3)
    choice = response.choices[0]
    record = choice.model_extra["prompt_images"]
    assert record == [{"sha256": hashlib.sha256(data).hexdigest(), "grid_thw": [1, 8, 4]}] * 2
    prompt = choice.model_extra["prompt_token_ids"]
    assert prompt.count(vision.image_token_id) == 2 * 8  # 8 x 4 patches, merged 2 x 2: 8 tokens each
    assert prompt.count(tok.convert_tokens_to_ids("<|vision_start|>")) == 2
    # streamed, the last chunk carries the same record
    chunks = list(client.chat.completions.create(model="vl", messages=messages, max_tokens=4, seed=3, stream=True))
    last = [c for c in chunks if c.choices and c.choices[0].finish_reason][0]
    assert last.choices[0].model_extra["prompt_images"] == record


# ---------------------------------------------------------------------------------------------------- training data


def _choice(tok: Any, prompt: list[int], text: str, images: list[dict[str, Any]] | None) -> Any:
    from openai.types.chat.chat_completion import Choice

    ids = tok(text + "<|im_end|>", add_special_tokens=False).input_ids
    data = {"index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": text},
            "logprobs": {"content": [{"token": "t", "logprob": -1.0, "bytes": None, "top_logprobs": []}
                                     for _ in ids]},
            "token_ids": ids, "prompt_token_ids": prompt}
    if images is not None:
        data["prompt_images"] = images
    return Choice.model_validate(data)


def _served_prompt(vision: VisionInputs, tok: Any, messages: list[dict[str, Any]]) -> tuple[list[int], list[Any]]:
    from artrl.chat.format import image_urls, render_prompt, template_message

    images = [vision.process(vision.load(url, place)) for _, place, url in image_urls(messages, "m")]
    ids = render_prompt(tok, [template_message(m) for m in messages], images=vision.image_tokens(images))
    return ids, images


def test_a_text_only_model_refuses_images_in_training_data_naming_the_part(tok):
    traj = art.Trajectory(messages_and_choices=[
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello"},
        {"role": "tool", "content": vision_content("look", "red")},
        {"role": "assistant", "content": "Red."}])
    with pytest.raises(ImageError, match=r"^trajectories\[0\]: messages_and_choices\[2\]\.content\[1\] is an "
                                         r"image, and this model has no vision tower"):
        tokenize_sft([traj], tok)


def test_images_in_tool_results_and_additional_histories_train_with_sft(vl):
    _, tok, vision = vl
    traj = art.Trajectory(
        messages_and_choices=[{"role": "user", "content": vision_content("Colour?", "red")},
                              {"role": "assistant", "content": "Red."},
                              {"role": "tool", "content": vision_content("and", "blue", (112, 56))},
                              {"role": "assistant", "content": "Blue."}],
        additional_histories=[art.History(messages_and_choices=[
            {"role": "user", "content": vision_content("Sub-agent, colour?", "green")},
            {"role": "assistant", "content": "Green."}])])
    result = tokenize_sft([traj], tok, vision=vision)
    main, sub = result.sequences
    assert [(image.digest[:8], image.grid) for _, image in main.images] == [
        (hashlib.sha256(base64.b64decode(image_url(c, s).split(",")[1])).hexdigest()[:8], g)
        for c, s, g in (("red", (56, 56), (1, 4, 4)), ("blue", (112, 56), (1, 4, 8)))]
    assert [main.token_ids[s:s + i.tokens] for s, i in main.images] == [[vision.image_token_id] * 4,
                                                                      [vision.image_token_id] * 8]
    assert sub.history_index == 1 and len(sub.images) == 1 and sub.rope_positions.shape == (3, len(sub))


def test_a_record_naming_an_image_no_message_holds_is_refused(vl):
    _, tok, vision = vl
    messages = [{"role": "user", "content": vision_content("Colour?", "red")}]
    prompt, images = _served_prompt(vision, tok, messages)
    record = [{"sha256": images[0].digest, "grid_thw": list(images[0].grid)}]
    good = art.Trajectory(messages_and_choices=[*messages, _choice(tok, prompt, "Red.", record)], reward=1.0)
    bad = art.Trajectory(messages_and_choices=[{"role": "user", "content": vision_content("Colour?", "blue")},
                                               _choice(tok, prompt, "Red.", record)], reward=0.0)
    with pytest.raises(ImageError, match=r"group 0, trajectory 1: messages_and_choices\[1\]: prompt_images\[0\] "
                                         r"names image sha256 .* which no message before the choice holds"):
        tokenize_groups([art.TrajectoryGroup([good, bad])], tok, vision=vision)
    wrong_grid = [{"sha256": images[0].digest, "grid_thw": [1, 8, 8]}]
    other = art.Trajectory(messages_and_choices=[*messages, _choice(tok, prompt, "Red.", wrong_grid)], reward=0.0)
    with pytest.raises(ImageError, match=r"has grid \[1, 4, 4\] under this model's image processor and the server "
                                         r"recorded \[1, 8, 8\]"):
        tokenize_groups([art.TrajectoryGroup([good, other])], tok, vision=vision)
    result = tokenize_groups([art.TrajectoryGroup([good, good.model_copy(update={"reward": 0.0})])], tok,
                             vision=vision)
    assert result.stats.record_turns == 2 and all(len(s.images) == 1 for s in result.sequences)


def test_trajectories_share_a_prompt_up_to_the_first_image_they_do_not_share(vl):
    _, tok, vision = vl
    groups = []
    for colours in (("red", "red"), ("red", "blue")):  # one image, or two of one size (the same token ids)
        trajs = []
        for k, colour in enumerate(colours):
            messages = [{"role": "user", "content": vision_content("Colour?", colour)}]
            prompt, images = _served_prompt(vision, tok, messages)
            record = [{"sha256": images[0].digest, "grid_thw": list(images[0].grid)}]
            trajs.append(art.Trajectory(messages_and_choices=[*messages, _choice(tok, prompt, "Red" * (k + 1), record)],
                                        reward=float(k)))
        groups.append(tokenize_groups([art.TrajectoryGroup(trajs)], tok, vision=vision).groups[0])
    same, other = (pack([g], row_length=128) for g in groups)
    (start, image), = same.images[0][:1]
    assert len(same.images[0]) == 1  # the shared prompt holds the image once
    prompt_end = same.nodes[0][0][1]
    assert start + image.tokens <= prompt_end
    assert [i.digest for _, i in other.images[0]] == [s.images[0][1].digest for s in groups[1]]  # both, in order
    assert other.nodes[0][0][1] == groups[1][0].images[0][0]  # the shared prompt ends where the images begin


def test_a_truncation_never_cuts_an_image(vl):
    _, tok, vision = vl
    messages = [{"role": "user", "content": "Hi"}]
    traj = art.Trajectory(messages_and_choices=[*messages, {"role": "assistant", "content": "Hello"},
                                                {"role": "tool", "content": vision_content("Now?", "red")},
                                                {"role": "assistant", "content": "Red."}])
    seq = tokenize_sft([traj], tok, vision=vision).sequences[0]
    start, image = seq.images[0]
    cut = _truncate(seq, start + 2)  # inside the image
    assert len(cut) == start and cut.images == [] and cut.rope_positions.shape == (3, start)


def test_vllm_with_a_vision_language_model_is_one_config_error(tmp_path):
    from artrl.serve.engines.factory import resolve_engine_kind

    with pytest.raises(ConfigError, match="inference_engine='vllm' with a vision-language model"):
        resolve_engine_kind("vllm", "cpu", vision=True)
    assert resolve_engine_kind("auto", "cuda", vision=True) == "builtin"

    async def main() -> None:
        model = art.TrainableModel(name="m", project="p", base_model="artrl/tiny-vl",
                                   _internal_config=art.InternalModelConfig(inference_engine="vllm"))
        async with art.LocalBackend(path=str(tmp_path), show_progress=False) as backend:
            with pytest.raises(ConfigError, match="artrl serves images with its built-in engine only"):
                await model.register(backend)

    import asyncio

    asyncio.run(main())



def test_a_template_that_drops_images_is_refused_not_silently_trained(vl):
    """A real checkpoint's template may not render image parts in some role; the image would then be lost."""
    import copy

    from artrl.models.tiny import CHAT_TEMPLATE

    _, tok, vision = vl
    blind = copy.deepcopy(tok)
    blind.chat_template = CHAT_TEMPLATE  # the text model's: text parts only
    traj = art.Trajectory(messages_and_choices=[{"role": "user", "content": vision_content("Colour?", "red")},
                                                {"role": "assistant", "content": "Red."}])
    assert len(tokenize_sft([traj], tok, vision=vision).sequences[0].images) == 1
    with pytest.raises(ImageError, match=r"the chat template wrote 0 image placeholders \(<\|image_pad\|>\) for 1 "
                                         r"images"):
        tokenize_sft([traj], blind, vision=vision)


def test_training_workers_with_a_vision_language_model_are_one_config_error(tmp_path):
    import asyncio

    async def main() -> None:
        model = art.TrainableModel(name="m", project="p", base_model="artrl/tiny-vl",
                                   _internal_config=art.InternalModelConfig(train_in_worker=True))
        async with art.LocalBackend(path=str(tmp_path), show_progress=False) as backend:
            with pytest.raises(ConfigError, match="training workers .* do not run its vision tower yet"):
                await model.register(backend)

    asyncio.run(main())


def test_processed_images_are_kept_by_content_hash_within_a_byte_bound(vl, monkeypatch):
    from artrl.models import vision as vision_module

    _, tok, vision = vl
    fresh = VisionInputs(vision.processor, tok, vl[0].config)
    red = fresh.process(load_image(image_url("red"), fresh.policy, "x"))
    assert fresh.process(load_image(image_url("red"), fresh.policy, "x")) is red  # the same content: processed once
    monkeypatch.setattr(vision_module, "CACHE_BYTES", red.pixels.numel() * red.pixels.element_size())
    fresh.process(load_image(image_url("blue"), fresh.policy, "x"))
    assert list(fresh._cache) == [fresh.process(load_image(image_url("blue"), fresh.policy, "x")).digest]


def test_an_image_prompt_decodes_the_same_alone_or_left_padded_in_a_batch(vl):
    """The prefill places each prompt's 3-D positions after its left padding, and decoding continues from the
    position after the prompt's last: a row's logits do not depend on its batch."""
    from artrl.serve.engines.decode_batch import DecodeBatch
    from artrl.serve.engines.base import GenerationRequest
    from artrl.serve.engines.transformers_engine import _cache_kwarg_name

    model, tok, vision = vl
    image_prompt, images = _served_prompt(vision, tok, [{"role": "user", "content": vision_content("Hue?", "blue",
                                                                                                   (112, 84))}])
    text_prompt, _ = _served_prompt(vision, tok, [{"role": "user", "content": "A much longer question, with no "
                                                                               "picture at all, to pad the other."}])
    assert len(text_prompt) > len(image_prompt)

    class Row:
        request = GenerationRequest(prompt_ids=[0], max_tokens=4)

    def batch(prompts: list[list[int]], pictures: list[list[Any]]) -> DecodeBatch:
        b = DecodeBatch(model, _cache_kwarg_name(model), tok.pad_token_id, torch.device("cpu"), vision=vision)
        n = len(prompts)
        b.admit([Row() for _ in prompts], prompts, list(range(n)), list(range(n)), [1.0] * n, [1.0] * n,
                images=pictures)
        return b

    with torch.inference_mode():
        alone = batch([image_prompt], [images])
        together = batch([text_prompt, image_prompt], [[], images])
        steps = [(alone.logits[0].clone(), together.logits[1].clone())]
        fed = tok("red blue", add_special_tokens=False).input_ids
        for token in fed:  # two decode steps
            alone._tokens = torch.tensor([token])
            together._tokens = torch.tensor([token, token])
            alone.advance()
            together.advance()
            steps.append((alone.logits[0].clone(), together.logits[1].clone()))
        # decoding continues at the positions a prefill of the longer prompt gives its last tokens
        longer = batch([image_prompt + fed], [images]).logits[0]
        # the images matter: the same prompt without them (plain token embeddings, 1-D positions) differs
        flat = DecodeBatch(model, _cache_kwarg_name(model), tok.pad_token_id, torch.device("cpu"))
        flat.admit([Row()], [image_prompt], [0], [0], [1.0], [1.0])  # no images: image tokens as plain tokens
    for a, b in steps:
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(steps[-1][0], longer, rtol=1e-4, atol=1e-4)
    assert (flat.logits[0] - steps[0][0]).abs().max() > 1e-2
