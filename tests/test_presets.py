"""The tiny-flux preset is a real, loadable, runnable and reproducible FluxPipeline built without a hub."""

import json
import logging
import random
from collections import Counter
from itertools import pairwise

import pytest
import torch
from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel
from transformers import CLIPTextModel, CLIPTokenizer, T5EncoderModel, T5TokenizerFast

from rollout_server.families.common import tokenizers
from rollout_server.families.common.build import TOKENIZER_LENGTH
from rollout_server.families.common.published import CLIP_L, FLUX_1_VAE, T5_XXL
from rollout_server.families.flux.published import FLUX_1_DEV, TINY
from rollout_server.presets import default_cache_dir, preset_names, resolve_model

UNSEEN_TEXT = "Quokkas juggle 9876 glowing xylophones in Zurich!"


@pytest.fixture(scope="module")
def tiny_flux(cache_dir):
    return resolve_model("tiny-flux", cache_dir=cache_dir)


@pytest.fixture(scope="module")
def pipe(tiny_flux):
    return FluxPipeline.from_pretrained(tiny_flux, dtype=torch.float32)


def test_components_are_real_flux_classes(pipe):
    assert isinstance(pipe.transformer, FluxTransformer2DModel)
    assert isinstance(pipe.vae, AutoencoderKL)
    assert isinstance(pipe.text_encoder, CLIPTextModel)
    assert isinstance(pipe.text_encoder_2, T5EncoderModel)
    assert isinstance(pipe.tokenizer, CLIPTokenizer)
    assert isinstance(pipe.tokenizer_2, T5TokenizerFast)
    assert isinstance(pipe.scheduler, FlowMatchEulerDiscreteScheduler)
    assert pipe.vae_scale_factor == 8
    assert pipe.transformer.config.guidance_embeds
    assert pipe.transformer.config.in_channels == 4 * pipe.vae.config.latent_channels
    assert pipe.scheduler.config.use_dynamic_shifting
    assert all(p.dtype == torch.float32 for p in pipe.transformer.parameters())


def test_pipeline_generates_an_image(pipe):
    image = pipe(
        "a red fox in the snow",
        height=64,
        width=64,
        num_inference_steps=2,
        output_type="pt",
        generator=torch.Generator().manual_seed(0),
    ).images
    assert image.shape == (1, 3, 64, 64)
    assert torch.isfinite(image).all()


def test_second_resolve_reuses_the_build(tiny_flux, caplog):
    index_mtime = (tiny_flux / "model_index.json").stat().st_mtime_ns
    with caplog.at_level(logging.INFO, logger="rollout_server.presets"):
        assert resolve_model("tiny-flux", cache_dir=tiny_flux.parent.parent) == tiny_flux
    assert not caplog.records
    assert (tiny_flux / "model_index.json").stat().st_mtime_ns == index_mtime
    assert not [
        p for p in tiny_flux.parent.iterdir() if p.name.startswith(f".{tiny_flux.name}")
    ]  # no staging left


def test_builds_are_byte_identical(tiny_flux, tmp_path, caplog):
    with caplog.at_level(logging.INFO, logger="rollout_server.presets"):
        rebuilt = resolve_model("tiny-flux", cache_dir=tmp_path)
    assert len(caplog.records) == 1
    files = sorted(p.relative_to(tiny_flux) for p in tiny_flux.rglob("*") if p.is_file())
    assert files == sorted(p.relative_to(rebuilt) for p in rebuilt.rglob("*") if p.is_file())
    assert "transformer/diffusion_pytorch_model.safetensors" in map(str, files)
    for file in files:
        assert (tiny_flux / file).read_bytes() == (rebuilt / file).read_bytes(), file


def test_the_preset_is_the_published_checkpoint_with_its_size_overrides(pipe):
    """tiny-flux is FLUX.1-dev's builder at its TINY size: each component's saved config holds the size's
    value of every field the size names (a text encoder's vocabulary is its tokenizer's length), and the
    published value of every other field of the checkpoint's config."""
    components = {
        "transformer": (FLUX_1_DEV, None),
        "vae": (FLUX_1_VAE, None),
        "text_encoder": (CLIP_L, pipe.tokenizer),
        "text_encoder_2": (T5_XXL, pipe.tokenizer_2),
    }
    for name, (published, tokenizer) in components.items():
        config = getattr(pipe, name).config
        size = {
            key: len(tokenizer) if value is TOKENIZER_LENGTH else value for key, value in TINY[name].items()
        }
        given = {**published, **size}
        # A transformers config as its class reads what it is given (T5's ties its embeddings whatever it
        # is told); JSON, as the files hold them (a tuple of the data is a list of the config).
        transformers_config = hasattr(config, "to_dict")
        expected = type(config)(**given).to_dict() if transformers_config else given
        saved = config.to_dict() if transformers_config else dict(config)
        assert json.loads(json.dumps({key: saved[key] for key in given})) == json.loads(
            json.dumps({key: expected[key] for key in given})
        ), name


def test_clip_tokenizer_round_trips_unseen_text(pipe):
    text = UNSEEN_TEXT + " ¿Qué? émojis 😀 中文"
    ids = pipe.tokenizer(
        text,
        padding="max_length",
        max_length=77,
        truncation=True,
        return_overflowing_tokens=False,
        return_length=False,
        return_tensors="pt",
    ).input_ids
    assert ids.shape == (1, 77)
    decoded = pipe.tokenizer.decode(ids[0], skip_special_tokens=True)
    assert decoded.replace(" ", "") == text.lower().replace(" ", "")  # CLIP lowercases and splits punctuation


def test_t5_tokenizer_round_trips_unseen_text(pipe):
    tokenizer = pipe.tokenizer_2
    ids = tokenizer(
        UNSEEN_TEXT,
        padding="max_length",
        max_length=512,
        truncation=True,
        return_length=False,
        return_overflowing_tokens=False,
        return_tensors="pt",
    ).input_ids[0]
    assert ids.shape == (512,)
    assert tokenizer.unk_token_id not in ids
    assert (tokenizer.pad_token_id, tokenizer.eos_token_id) == (0, 1)
    assert ids[-1] == tokenizer.pad_token_id
    assert tokenizer.decode(ids, skip_special_tokens=True) == UNSEEN_TEXT


def merged(word: tuple[str, ...], pair: tuple[str, str]) -> tuple[str, ...]:
    symbols, i = [], 0
    while i < len(word):
        if word[i : i + 2] == pair:
            symbols.append(pair[0] + pair[1])
            i += 2
        else:
            symbols.append(word[i])
            i += 1
    return tuple(symbols)


def reference_bpe_merges(counts: Counter, num_merges: int) -> list[tuple[str, str]]:
    """BPE training as its definition reads: count every adjacent pair of every word, merge the most
    frequent (the smallest pair on a tie) left to right in every word, and again."""
    words, merges = dict(counts), []
    while len(merges) < num_merges:
        pairs = Counter()
        for word, freq in words.items():
            for pair in pairwise(word):
                pairs[pair] += freq
        if not pairs:
            break
        best = min(pairs, key=lambda pair: (-pairs[pair], pair))
        merges.append(best)
        words = {merged(word, best): freq for word, freq in words.items()}
    return merges


def test_the_tokenizers_bpe_training_is_the_definitions():
    """The presets' BPE trainer updates pair counts incrementally; its merges are the recount-everything
    definition's, on the CLIP corpus and on random words of three letters (runs like "aaaa" whose pairs
    overlap, ties, and symbols one string makes by several merges)."""
    rng = random.Random(0)
    letters = Counter(tuple(rng.choices("abc", k=rng.randint(1, 8))) for _ in range(300))
    clip = tokenizers._clip_word_counts(tokenizers.CORPUS.splitlines())
    for counts, num_merges in ((letters, 10_000), (letters, 7), (clip, 300)):
        assert tokenizers._train_bpe_merges(counts, num_merges) == reference_bpe_merges(counts, num_merges)


def test_resolve_model_accepts_folders_and_rejects_unknown_names(tiny_flux, tmp_path):
    assert resolve_model(str(tiny_flux)) == tiny_flux
    with pytest.raises(FileNotFoundError, match="model_index.json"):
        resolve_model(str(tmp_path))
    with pytest.raises(FileNotFoundError, match="tiny-flux"):
        resolve_model("no-such-preset")
    assert {"tiny-flux", "small-flux"} <= set(preset_names())


def test_default_cache_dir_honours_env(monkeypatch, tmp_path):
    monkeypatch.setenv("ROLLOUT_SERVER_CACHE", str(tmp_path))
    assert default_cache_dir() == tmp_path
    monkeypatch.delenv("ROLLOUT_SERVER_CACHE")
    assert default_cache_dir().parts[-2:] == (".cache", "rollout-server")
