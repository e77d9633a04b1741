"""Vision-language fine-tuning (data=vision_chat, model.arch=llava; issue 63): conversations with images in TRL's
format, labelled as TRL's collator labels them, a tiny LLaVA that learns to name a square's colour, the strategies
that shard it equal to one process, LoRA on its language model alone, and bad rows refused naming the row."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from helpers import (
    compose, grad_norms, losses, read_metrics, reference_run, run_log, sample_lines, script, train, warm,
)

SQUARES = script("vision_squares")
TOLERANCE = 1e-5  # fp32, relative


@pytest.fixture(scope="module")
def squares(tmp_path_factory) -> Path:
    """The example set (scripts/vision_squares.py): 300 squares and their colours."""
    return SQUARES.write(tmp_path_factory.mktemp("squares"), rows=300, seed=0)


def vision_run(path: Path, *overrides: str, preset: str = "smoke") -> list[str]:
    """The smoke preset's tiny LLaVA on `path` (`preset`: more presets after smoke, e.g. "smoke,fsdp")."""
    return [f"+preset=[{preset}]", "model.arch=llava", "data=vision_chat", f"data.path={path}", "data.seq_len=80",
            "model.num_layers=2", "model.hidden_size=64", "model.num_heads=2", *overrides]


def run_processor(cfg):
    """The run's processor and tokenizer for `cfg`, as the build makes them."""
    from trainloop.data.loaders import run_tokenizer
    from trainloop.model.vision import processor_of

    tokenizer = run_tokenizer(cfg)
    return processor_of(tokenizer), tokenizer


def mixed_rows(directory: Path) -> Path:
    """Conversations of every shape the format takes: a system turn, two images in one turn, an image in a later
    turn, a user turn of text alone, string contents, two replies."""
    images = [image for _, image in SQUARES.squares(3, seed=5)]
    for n, image in enumerate(images):
        image.save(directory / f"m{n}.png")
    text = lambda t: {"type": "text", "text": t}  # noqa: E731
    rows = [
        {"messages": [{"role": "system", "content": "Answer in one word."},
                      {"role": "user", "content": [{"type": "image"}, text("and"), {"type": "image"},
                                                   text("Which is bigger?")]},
                      {"role": "assistant", "content": [text("the first")]}], "images": ["m0.png", "m1.png"]},
        {"messages": [{"role": "user", "content": [text("Hello")]}, {"role": "assistant", "content": "Hi, show me."},
                      {"role": "user", "content": [text("This one:"), {"type": "image"}]},
                      {"role": "assistant", "content": [text("blue")]}], "images": ["m2.png"]},
        {"messages": [{"role": "user", "content": [text("No picture today.")]},
                      {"role": "assistant", "content": "Fine."}], "images": []},
        # text alone, with an image: before the first user turn's text, as TRL places it
        {"messages": [{"role": "user", "content": "What is this?"}, {"role": "assistant", "content": "A square."}],
         "images": ["m0.png"]},
    ]
    path = directory / "mixed.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_the_labels_and_pixels_are_trls(tmp_path, squares):
    """Check 2: each conversation's tokens, labels and pixels equal what TRL's collator for vision-language models
    gives on the same row and processor (assistant_only_loss: the template's {% generation %} mask). Image and
    prompt tokens carry no label."""
    from trl.trainer.sft_trainer import DataCollatorForVisionLanguageModeling

    from trainloop.data.sets import open_image
    from trainloop.data.loaders import build_datasets
    from trainloop.data.packing import split_documents
    from trainloop.data.tokenizer import IGNORE
    from trainloop.model.vision import image_token_id

    path = mixed_rows(squares.parent)
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    rows += [json.loads(line) for line in squares.read_text().splitlines()[:5]]
    both = tmp_path / "rows.jsonl"
    both.write_text("".join(json.dumps({**r, "images": [str(squares.parent / i) for i in r["images"]]}) + "\n"
                            for r in rows))
    cfg = compose(*vision_run(both, "data.seq_len=160", "data.validation_fraction=0.2"))
    processor, tokenizer = run_processor(cfg)
    train_set, valid_set = build_datasets(cfg.data, tokenizer, cfg.trainer.seed)
    held_out = set(split_documents(len(rows), 0.2, cfg.trainer.seed).tolist())
    order = [r for r in range(len(rows)) if r not in held_out] + sorted(held_out)
    ours = [train_set.__getitems__([i]) for i in range(len(train_set))]
    ours += [valid_set.__getitems__([i]) for i in range(len(valid_set))]
    collator = DataCollatorForVisionLanguageModeling(processor, assistant_only_loss=True)
    image = image_token_id(processor)
    for r, mine in zip(order, ours):
        row = rows[r]
        theirs = collator([{"messages": row["messages"],
                            "images": [open_image(str(squares.parent / i)) for i in row["images"]]}])
        length = int(mine["attention_mask"].sum())
        assert mine["input_ids"][0, :length].tolist() == theirs["input_ids"][0].tolist(), r
        assert mine["labels"][0, :length].tolist() == theirs["labels"][0].tolist(), r
        assert (mine["labels"][0, length:] == IGNORE).all() and not (mine["labels"] == image).any()
        if row["images"]:
            assert torch.equal(mine["pixel_values"], theirs["pixel_values"]), r
        else:
            assert "pixel_values" not in mine
        replies = [m for m in row["messages"] if m["role"] == "assistant"]
        trained = [t for t in mine["labels"][0].tolist() if t != IGNORE]
        words = "".join(m["content"] if isinstance(m["content"], str) else m["content"][0]["text"] for m in replies)
        assert tokenizer.decode(trained).replace(tokenizer.eos_token, "") == words  # the replies, nothing else


def test_images_as_bytes_in_parquet_read_as_their_paths(tmp_path, squares):
    """A parquet file written by `datasets` with an Image feature (the images' bytes, TRL's hub datasets' form)
    gives the same rows as the jsonl of paths: tokens, labels and pixels."""
    import datasets

    from trainloop.data.loaders import build_datasets

    rows = [json.loads(line) for line in squares.read_text().splitlines()[:12]]
    table = datasets.Dataset.from_dict({"messages": [r["messages"] for r in rows],
                                        "images": [[str(squares.parent / i) for i in r["images"]] for r in rows]})
    table.cast_column("images", datasets.Sequence(datasets.Image())).to_parquet(tmp_path / "rows.parquet")
    paths = tmp_path / "rows.jsonl"
    paths.write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "images").symlink_to(squares.parent / "images")
    built = []
    for path in (tmp_path / "rows.parquet", paths):
        cfg = compose(*vision_run(path))
        train_set, _ = build_datasets(cfg.data, run_processor(cfg)[1], cfg.trainer.seed)
        built.append(train_set.__getitems__(list(range(len(train_set)))))
    (from_bytes, from_paths) = built
    assert from_bytes.keys() == from_paths.keys() and "pixel_values" in from_bytes
    assert all(torch.equal(from_bytes[k], from_paths[k]) for k in from_bytes)


@pytest.mark.slow
def test_a_pretrained_vlm_directory_trains_as_model_hf(tmp_path, squares):
    """Item 2: model=hf with a vision-language model's directory (weights, config, processor): its processor and
    chat template are the run's, and final/ loads again with transformers alone."""
    from transformers import AutoModelForImageTextToText, AutoProcessor

    cfg = compose(*vision_run(squares))
    model = built_model(cfg)
    model.save_pretrained(tmp_path / "vlm")
    run_processor(cfg)[0].save_pretrained(tmp_path / "vlm")
    run = train(tmp_path / "run", "+preset=smoke", "model=hf", f"model.name_or_path={tmp_path / 'vlm'}",
                "data=vision_chat", f"data.path={squares}", "data.seq_len=80", "trainer.max_steps=4",
                "trainer.eval_every=4", "checkpoint.save_final_model=true", small=False)
    rates = [r["lr"] for r in read_metrics(run) if "lr" in r]
    assert rates and max(rates) <= 2e-5  # a pretrained model's default rate (TRL's SFTConfig), not 1e-3
    loaded = AutoModelForImageTextToText.from_pretrained(run / "final")
    assert type(loaded).__name__ == "LlavaForConditionalGeneration"
    assert AutoProcessor.from_pretrained(run / "final").chat_template == run_processor(cfg)[0].chat_template


def test_inspect_shows_a_conversation_as_the_model_sees_it_with_its_image_tokens(squares):
    """python -m trainloop.inspect with data=vision_chat: each row's tokens as the run makes them (the template's
    text, an image's tokens as the processor expands it), the trained ones (the reply, never an image's) marked, the
    same ids and labels the training rows hold."""
    from trainloop.data.loaders import build_datasets
    from trainloop.inspect import inspect_rows

    cfg = compose(*vision_run(squares))
    shown = inspect_rows(vision_run(squares), 2)
    first = json.loads(squares.read_text().splitlines()[0])
    reply = first["messages"][-1]["content"][0]["text"]
    train_set, _ = build_datasets(cfg.data, run_processor(cfg)[1], cfg.trainer.seed)
    held = train_set.tensors  # every row of the example set is one shape: the same lengths
    trained = int((held["labels"][0] != -100).sum())
    assert shown.startswith(f"--- row 0: {int(held['attention_mask'][0].sum())} tokens, {trained} trained\n")
    image = run_processor(cfg)[0].tokenizer.convert_tokens_to_ids("<image>")
    image_tokens = int((held["input_ids"][0] == image).sum())
    assert image_tokens > 1 and shown.split("--- row 1")[0].count("<image>") == image_tokens
    assert f"[[{reply}" in shown and SQUARES.QUESTION in shown and "--- row 1:" in shown


def test_a_processor_that_needs_a_library_this_environment_lacks_is_refused_naming_it(tmp_path):
    """A Qwen2-VL directory's processor takes a video processor, which needs torchvision (not a dependency of
    trainloop's): model=hf is refused in one line that names model.name_or_path and the library, not with
    transformers' traceback."""
    import importlib.util

    from transformers import Qwen2VLImageProcessorPil

    from trainloop.errors import ConfigError
    from trainloop.model.vision import vision_processor

    if importlib.util.find_spec("torchvision") is not None:
        pytest.skip("torchvision is installed here: the processor loads")
    cfg = compose("+preset=smoke", "model=hf", f"model.name_or_path={tmp_path}")
    run_processor(compose(*vision_run(Path("rows.jsonl"))))[1].save_pretrained(tmp_path)
    Qwen2VLImageProcessorPil().save_pretrained(tmp_path)
    (tmp_path / "processor_config.json").write_text(json.dumps({"processor_class": "Qwen2VLProcessor"}))
    with pytest.raises(ConfigError) as refused:
        vision_processor(cfg.model)
    message = str(refused.value)
    assert "\n" not in message and message.startswith(f"model.name_or_path='{tmp_path}': its processor cannot load")
    assert "requires the Torchvision library" in message and "the torchvision release made for torch" in message


@pytest.mark.parametrize("fault, says", [
    ("missing", "image 1 'WHERE/gone.png': no such file"),
    ("not an image", "is not an image (UnidentifiedImageError"),
    ("part without image", "an image part with no image: 2 {\"type\": \"image\"} part(s) and 1 image(s)"),
    ("more images", "more images than image parts: 1 {\"type\": \"image\"} part(s) and 2 image(s)"),
    ("image in a reply", "message 2 (assistant) part 1 is an image; only the user's messages hold images"),
])
def test_a_bad_row_is_refused_in_one_line_naming_it(tmp_path, fault, says):
    """Check 4: a row whose image is missing or not an image, an image part with no image, more images than parts:
    one line naming FILE:LINE, before any compute."""
    from trainloop.data.loaders import load_examples
    from trainloop.errors import ConfigError

    good = [(c, i) for c, i in SQUARES.squares(2, seed=1)]
    for n, (_, image) in enumerate(good):
        image.save(tmp_path / f"{n}.png")
    (tmp_path / "text.png").write_text("not a picture")
    rows = [{"messages": SQUARES.conversation(c), "images": [f"{n}.png"]} for n, (c, _) in enumerate(good)]
    bad = {"missing": {"messages": SQUARES.conversation("red"), "images": ["gone.png"]},
           "not an image": {"messages": SQUARES.conversation("red"), "images": ["text.png"]},
           "part without image": {"messages": [{"role": "user", "content": [{"type": "image"}, {"type": "image"}]},
                                               {"role": "assistant", "content": "red"}], "images": ["0.png"]},
           "more images": {"messages": SQUARES.conversation("red"), "images": ["0.png", "1.png"]},
           "image in a reply": {"messages": [{"role": "user", "content": "Draw"},
                                             {"role": "assistant", "content": [{"type": "image"}]}],
                                "images": ["0.png"]}}[fault]
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in [*rows, bad]))
    cfg = compose(*vision_run(path))
    with pytest.raises(ConfigError) as refused:
        load_examples(cfg.data, run_processor(cfg)[1])
    message = str(refused.value)
    assert "\n" not in message and message.startswith(f"{path}:3: ") and says.replace("WHERE", str(tmp_path)) in message


def test_an_image_whose_header_passes_but_pixels_do_not_is_refused_naming_its_row(tmp_path):
    """The rows are checked by their images' headers (no decode); the one decode, for the processor, names the row of
    a file cut short after its header, as the header check names a row."""
    from trainloop.data.formats import data_format
    from trainloop.data.loaders import load_examples
    from trainloop.errors import ConfigError

    (colour, image), = SQUARES.squares(1, seed=2)
    image.save(tmp_path / "whole.jpg")
    whole = (tmp_path / "whole.jpg").read_bytes()
    (tmp_path / "cut.jpg").write_bytes(whole[:-100])  # its headers whole, its pixels cut short
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps({"messages": SQUARES.conversation(colour), "images": [name]}) + "\n"
                            for name in ("whole.jpg", "cut.jpg")))
    cfg = compose(*vision_run(path))
    processor, tokenizer = run_processor(cfg)
    assert [r for r, _, _ in load_examples(cfg.data, tokenizer)] == [0, 1]  # the cut file's header is whole
    with pytest.raises(ConfigError) as refused:
        data_format("vision_chat").build(cfg.data, tokenizer, seed=0)
    message = str(refused.value)
    assert "\n" not in message and message.startswith(f"{path}:2: data.images_field='images' image 1 ")
    assert f"'{tmp_path / 'cut.jpg'}' is not an image (OSError: image file is truncated" in message


@pytest.mark.parametrize("overrides, says", [
    (["data.packing=documents"], "data.packing=documents: data=vision_chat pads each conversation"),
    (["data.path=null", "data.sources=[{path:a.jsonl,weight:1}]"],
     "data.sources with data=vision_chat: a mixture of conversations with images is not built yet; give data.path"),
    (["data=chat", "data.path=x.jsonl"], "model.arch=llava trains on images: set data=vision_chat"),
    (["model.freeze=[eyes]"], "model.freeze=['eyes']: ['eyes'] not among the parts vision, projector"),
    (["model.image_size=30"], "model.image_size=30 is not a multiple of model.patch_size=8"),
    (["model=hf", "model.name_or_path=/a/vlm", "data.tokenizer=/a/tokenizer"],
     "data.tokenizer=/a/tokenizer with model=hf and data=vision_chat: the model's processor"),
    (["parallel.pp_size=2"], "parallel.pp_size=2 with data=vision_chat: not for a vision-language model yet"),
    (["objective=distill", "objective.teacher=/a/teacher"], "objective=distill with data=vision_chat: only"),
])
def test_what_a_vision_run_cannot_do_is_refused_before_compute(overrides, says):
    from trainloop.config.compose import problems

    cfg = compose(*vision_run(Path("rows.jsonl"), *overrides))
    assert any(says in p for p in problems(cfg)), problems(cfg)


def test_lora_with_the_vision_tower_frozen_trains_only_the_language_models_adapters():
    """Check 3's second half: adapter=lora adapts the language model's linear layers alone (not the vision tower's,
    not the projector's), and with model.freeze=[vision, projector] and no adapter, those parts train not at all."""
    from trainloop.model.adapter import apply_adapter
    from trainloop.model.vision import freeze, part

    def built(*overrides):
        cfg = compose(*vision_run(Path("rows.jsonl"), *overrides))
        return cfg, built_model(cfg)

    cfg, model = built("adapter=lora", "model.freeze=[vision]")
    freeze(model, cfg.model.freeze)
    model = apply_adapter(cfg, model)
    trained = {n: p.numel() for n, p in model.named_parameters() if p.requires_grad}
    assert trained and all("lora_" in n and ".language_model." in n for n in trained), sorted(trained)[:4]
    layers = cfg.model.num_layers
    assert len(trained) == 2 * 7 * layers  # A and B of q, k, v, o, gate, up, down in each block
    assert not any(p.requires_grad for p in part(model, "vision").parameters())

    cfg, model = built("model.freeze=[vision,projector]")
    frozen = freeze(model, cfg.model.freeze)
    vision, projector = part(model, "vision"), part(model, "projector")
    assert frozen == sum(p.numel() for m in (vision, projector) for p in m.parameters()) > 0
    assert sum(p.numel() for p in model.parameters() if p.requires_grad) == \
        sum(p.numel() for p in model.parameters()) - frozen


def test_the_projector_learns_at_its_own_rate():
    """optimizer.projector_lr: the projector's parameters in groups of their own at that rate (weight decay as
    theirs), scheduled as the rest; the others at optimizer.lr."""
    from trainloop.model.vision import part
    from trainloop.optim.optimizers import build_optimizer, build_scheduler

    cfg = compose(*vision_run(Path("rows.jsonl"), "optimizer.lr=1e-3", "optimizer.projector_lr=5e-3",
                              "scheduler=constant"))
    model = built_model(cfg)
    optimizer = build_optimizer(cfg.optimizer, model, on_cuda=False)
    projector = {id(p) for p in part(model, "projector").parameters()}
    rates = {id(p): g["lr"] for g in optimizer.param_groups for p in g["params"]}
    assert rates.keys() == {id(p) for p in model.parameters()}
    assert {rates[i] for i in projector} == {5e-3} and {r for i, r in rates.items() if i not in projector} == {1e-3}
    assert sorted(g["weight_decay"] for g in optimizer.param_groups if g["lr"] == 5e-3) == [0.0, 0.1]
    scheduler = build_scheduler(cfg.scheduler, optimizer, 10)
    optimizer.step()  # no gradients: nothing moves, but the scheduler's step follows an optimizer's, as in a run
    scheduler.step()
    assert {g["lr"] for g in optimizer.param_groups} == {1e-3, 5e-3}


def test_the_planner_counts_the_vision_tower_and_the_image_tokens():
    """Item 5: the plan's shape holds the vision tower and projector's parameters (as the built model has them) and
    an image's tokens; the plan counts the tower's activations for the micro-batch's images."""
    from trainloop.model.vision import part
    from trainloop.tools.plan import plan_memory
    from trainloop.tools.shape import model_shape

    cfg = compose(*vision_run(Path("rows.jsonl")))
    shape = model_shape(cfg)
    cfg_model = built_model(cfg)
    towers = sum(p.numel() for name in ("vision", "projector") for p in part(cfg_model, name).parameters())
    assert shape.vision_params == towers and shape.num_params == sum(p.numel() for p in cfg_model.parameters())
    assert (shape.image_tokens, shape.image_patches, shape.vision.num_layers) == (16, 17, 2)
    assert shape.num_layers == cfg.model.num_layers and shape.hidden == cfg.model.hidden_size  # the language model's
    plan = plan_memory(cfg, shape, 1, "cpu")
    line = next(x for x in plan.lines if x.what == "vision tower activations")
    assert line.bytes > 0 and "4 image(s) a micro-batch (one a row) x 17 patches" in line.note
    assert any("16 image tokens an image of each row's 80" in n for n in plan.notes)


def test_eval_images_are_one_a_prompt_and_must_exist(tmp_path):
    from trainloop.errors import ConfigError
    from trainloop.observe.samples import Samples

    cfg = compose(*vision_run(Path("rows.jsonl"), 'eval.prompts=["a","b"]', "eval.images=[x.png]"))
    tokenizer = run_processor(cfg)[1]
    with pytest.raises(ConfigError, match=r"eval.images holds 1 image\(s\) for 2 eval.prompts"):
        Samples.for_config(cfg, tokenizer, 256)
    cfg = compose(*vision_run(Path("rows.jsonl"), 'eval.prompts=["a"]', f"eval.images=[{tmp_path / 'x.png'}]"))
    with pytest.raises(ConfigError, match=r"eval.images\[0\]=.*x.png': no such file"):
        Samples.for_config(cfg, tokenizer, 256)


def built_model(cfg):
    """The run's model for `cfg` (from its shape: random weights), with the processor's image token."""
    from trainloop.model.builder import build_model, build_model_config, special_token_ids
    from trainloop.model.vision import image_token_id

    processor, tokenizer = run_processor(cfg)
    config = build_model_config(cfg.model, len(tokenizer),
                                {**special_token_ids(tokenizer), "image_token_id": image_token_id(processor)})
    return build_model(cfg.model, config)


def answers(final: Path, count: int = 40, seed: int = 1) -> float:
    """The share of squares (drawn from `seed`, none of the training set's) whose colour final/'s model names, loaded
    with transformers alone and asked as a user would, greedy."""
    from transformers import AutoModelForImageTextToText, AutoProcessor

    model = AutoModelForImageTextToText.from_pretrained(final).eval()
    processor = AutoProcessor.from_pretrained(final)
    right = 0
    for colour, image in SQUARES.squares(count, seed):
        messages = SQUARES.conversation(None)
        messages[0]["content"][0]["image"] = image
        inputs = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                               return_dict=True, return_tensors="pt")
        with torch.no_grad():
            out = model.generate(**inputs, max_new_tokens=8, do_sample=False)
        said = processor.tokenizer.decode(out[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True)
        right += said.strip() == colour
    return right / count


@pytest.mark.slow
def test_a_tiny_vlm_learns_to_name_the_squares_colour(tmp_path, squares):
    """Check 1: fine-tuned on 300 squares, the model names the colour of squares it has not seen at least 9 times
    in 10, judged by final/ loaded with transformers alone (AutoModelForImageTextToText, AutoProcessor). The
    samples the run writes at each evaluation ask about a held-out square too (eval.prompts with eval.images)."""
    colour, image = SQUARES.squares(1, seed=99)[0]
    image.save(tmp_path / "held_out.png")
    run = train(tmp_path / "run", *vision_run(squares, "trainer.max_steps=150", "trainer.log_every=50",
                                              "trainer.eval_every=75", "optimizer.lr=2e-3",
                                              "checkpoint.save_final_model=true", f'eval.prompts=["{SQUARES.QUESTION}"]',
                                              f"eval.images=[{tmp_path / 'held_out.png'}]"), small=False)
    assert {"processor_config.json", "chat_template.jinja", "model.safetensors"} <= {p.name for p in (run / "final").iterdir()}
    samples = sample_lines(run)
    assert [s["step"] for s in samples] == [75, 150]
    assert samples[-1]["samples"] == [{"prompt": SQUARES.QUESTION, "text": colour,
                                       "image": str(tmp_path / "held_out.png")}]
    share = answers(run / "final")
    print(f"right on {share:.0%} of unseen squares")
    assert share >= 0.9


@pytest.fixture(scope="module")
def one_process(tmp_path_factory, squares) -> Path:
    """1 process, batch 4, 2 accumulation steps: the micro-batches 2 ranks of batch 4 see."""
    return reference_run(tmp_path_factory, *vision_run(squares, "trainer.max_steps=10", "trainer.log_every=1",
                                                       "data.batch_size=4", "trainer.gradient_accumulation_steps=2",
                                                       "trainer.eval_every=10", "checkpoint.save_final_model=true"))


@pytest.mark.slow
@pytest.mark.parametrize("preset", ["fsdp", "zero3", "ddp"])
def test_two_processes_train_like_one(tmp_path, squares, one_process, preset):
    """Check 3: FSDP2 (the vision tower's blocks wrapped too), ZeRO-3 and DDP on 2 processes equal one process within
    1e-5 for 10 steps (losses and gradient norms), and final/ holds the same model."""
    run = tmp_path / preset
    warm(2, [*vision_run(squares, "precision=fp32", "trainer.max_steps=10", "trainer.log_every=1",
                         "data.batch_size=4", "trainer.eval_every=10", "checkpoint.save_final_model=true",
                         preset=f"smoke,{preset}"), f"hydra.run.dir={run}"], cwd=tmp_path)
    if preset == "fsdp":  # 2 Llama blocks, 2 CLIP encoder blocks and the vision embeddings, each sharded alone
        assert "6 modules sharded: 5 blocks + root" in run_log(run)
    for measure in (losses, grad_norms):
        got, want = measure(run), measure(one_process)
        assert set(got) == set(want) == set(range(1, 11))
        worst = max(abs(got[s] - want[s]) / abs(want[s]) for s in want)
        print(f"{preset}: {measure.__name__} within {worst:.1e} of 1 process")
        assert worst < TOLERANCE
    from transformers import AutoModelForImageTextToText

    mine, theirs = (AutoModelForImageTextToText.from_pretrained(d / "final").state_dict() for d in (run, one_process))
    assert mine.keys() == theirs.keys()
    assert max((mine[k] - theirs[k]).abs().max().item() for k in mine) < TOLERANCE
