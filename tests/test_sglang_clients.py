"""miles_diffusion's rollout client against the HTTP front end, its requests written as data: the JSON
bodies that its ``build_rollout_sampling_params`` and ``build_rollout_generate_payload``
(``miles/rollout/sglang_diffusion_rollout.py``) post for everyday configurations, posted as it posts
them. Each answer is decoded with SGLang's own ``_maybe_deserialize`` and cut as its
``RolloutTrainDataConverter`` cuts it into train pairs (x_i = latents[:-1][i], x_{i+1} = latents[1:][i],
timesteps[i] and the old log-prob, at every SDE step), and every such step replays from the answer alone
within TOLERANCE. What SGLang accepts and does not use is accepted here and named in the
X-Rollout-Ignored-Fields header."""

import re

import msgpack
import pytest
import test_sglang_api
import torch
from support.families import FAMILIES
from support.parity import TOLERANCE
from support.servers import http_url
from test_sglang_api import post, replayed_log_prob

from rollout_server.sglang import IGNORED_HEADER

sglang = test_sglang_api.sglang  # the fixture: SGLang's request model and codec, from its wheel
STEPS = 4
# build_rollout_sampling_params with miles' flag defaults (--diffusion-guidance-scale 4.0,
# --diffusion-output-num-frames 1, --diffusion-generator-device cuda, no --diffusion-negative-prompt or
# --diffusion-true-cfg-scale) at this test's size, completed by build_rollout_generate_payload: the
# negative prompt " " when the run sets none (FlowGRPO's default), a microgroup of two outputs and the
# group's seed.
MILES = {
    "generator_device": "cuda",
    "negative_prompt": " ",
    "width": 64,
    "height": 64,
    "num_inference_steps": STEPS,
    "guidance_scale": 4.0,
    "true_cfg_scale": None,
    "rollout": True,
    "rollout_sde_type": "sde",
    "rollout_noise_level": 0.7,
    "rollout_log_prob_no_const": False,
    "rollout_debug_mode": False,
    "rollout_return_denoising_env": True,
    "rollout_return_dit_trajectory": True,
    "num_frames": 1,
    "num_outputs_per_prompt": 2,
    "seed": 42,
}
WAN22_SCALES = {"transformer": 4.0, "transformer_2": 3.0}  # guidance_scale, guidance_scale_2 by expert


# (family, what the run's flags change in MILES, the fields named ignored, whether CFG runs)
ROWS = {
    # FLUX.1 [dev]: guidance 3.5 embedded, CFG off (true_cfg_scale unset): the negative prompt is unused.
    "flux-guidance-3.5": ("flux", {"guidance_scale": 3.5}, {"negative_prompt"}, False),
    # SD3 without CFG, on CPS.
    "sd3-cfg-off-cps": (
        "sd3",
        {"guidance_scale": 1.0, "rollout_sde_type": "cps"},
        {"negative_prompt"},
        False,
    ),
    # Wan 2.2 A14B with --diffusion-guidance-scale-2 3.0: the low-noise expert guides at 3.
    "wan2.2-guidance-scale-2": (
        "wan2.2",
        {"extra_sampling_params": {"guidance_scale_2": WAN22_SCALES["transformer_2"]}},
        set(),
        True,
    ),
    # Qwen-Image, true CFG 4; guidance_scale (miles' default 4) is not read without a guidance embedding.
    "qwen-image-true-cfg-4": ("qwen-image", {"true_cfg_scale": 4.0}, {"guidance_scale"}, True),
    # SD3 with CFG 4.5.
    "sd3-cfg-4.5": ("sd3", {"guidance_scale": 4.5}, set(), True),
    # Z-Image at miles' default CFG 4 (on above 0), with the blank negative prompt.
    "z-image-cfg-4": ("z-image", {}, set(), True),
    # LTX-2 as miles trains LTX-2.3: unguided, CPS without the constants, SDE on the steps its step
    # strategy draws (rollout_sde_step_indices), 8k + 1 frames.
    "ltx2-unguided-cps": (
        "ltx2",
        {
            "guidance_scale": 1.0,
            "rollout_sde_type": "cps",
            "rollout_log_prob_no_const": True,
            "num_frames": 9,
            "rollout_sde_step_indices": [1, 2],
        },
        {"negative_prompt"},
        False,
    ),
}
SAMPLERS = {"sde": "FLOW_SDE", "cps": "CPS", "dance": "DANCE"}


def generate(sglang, url: str, body: dict) -> tuple[list[dict], set[str]]:
    """POST a body as miles does (JSON): the answers decoded with SGLang's codec, and the fields the
    server named ignored."""
    answer = post(url, "/rollout/generate", body)
    assert answer.status_code == 200, answer.text
    named = answer.headers.get(IGNORED_HEADER)
    return [sglang.deserialize(item) for item in msgpack.unpackb(answer.content)], set(
        named.split(",") if named else ()
    )


def train_pairs(answer: dict, sde_steps: list[int]) -> dict[str, torch.Tensor]:
    """RolloutTrainDataConverter's per-timestep features of one sample: its whole trajectory cut into
    (x_i, x_{i+1}) pairs and indexed by the SDE steps, with their timesteps and old log-probs."""
    latents = answer["dit_trajectory"]["latents"].float()
    index = torch.as_tensor(sde_steps)
    return {
        "latent": latents[:-1][index],
        "next_latent": latents[1:][index],
        "timestep": answer["dit_trajectory"]["timesteps"].float()[index],
        "log_prob_old": answer["rollout_log_probs"][index],
    }


@pytest.mark.parametrize(("family", "fields", "ignored", "cfg"), ROWS.values(), ids=ROWS.keys())
def test_miles_payloads_train_pairs_replay(sglang, family_resources, family, fields, ignored, cfg):
    server = family_resources.server(family)
    body = {**MILES, "prompt": FAMILIES[family].prompts[0], **fields}
    answers, named = generate(sglang, http_url(server), body)
    assert named == ignored
    assert [a["seed"] for a in answers] == [42, 43]  # each sample its own seed, as SGLang numbers them
    sampler = SAMPLERS[body["rollout_sde_type"]]
    sde_steps = body.get("rollout_sde_step_indices", list(range(STEPS)))
    # CPS's last step has no noise (its sd is sigma_T sin(a pi / 2), sigma_T = 0): deterministic, 0.
    stochastic = [i for i in sde_steps if not (sampler == "CPS" and i == STEPS - 1)]
    transformer = family_resources.transformer(family)
    for answer in answers:
        trajectory, env = answer["dit_trajectory"], answer["denoising_env"]
        assert trajectory["latents"].shape[0] == STEPS + 1 and answer["rollout_log_probs"].shape == (STEPS,)
        assert torch.equal(trajectory["latent_step_indices"], torch.arange(STEPS + 1))
        assert (env["neg_cond_kwargs"] is not None) == cfg
        pairs = train_pairs(answer, sde_steps)
        assert [i for i, old in zip(sde_steps, pairs["log_prob_old"], strict=True) if old != 0] == stochastic
        for i in stochastic:
            replayed = replayed_log_prob(
                transformer,
                answer,
                i,
                sampler,
                constants=not body["rollout_log_prob_no_const"],
            )
            assert abs(replayed - answer["rollout_log_probs"][i].item()) <= TOLERANCE
        if family == "flux":  # the guidance is embedded, as SGLang reports it apart
            assert env["guidance"].tolist() == [3.5]
        if family == "wan2.2":  # both experts ran stochastic steps, each at its own scale
            assert {env["step_transformers"][i] for i in sde_steps} == set(WAN22_SCALES)
            scales = [WAN22_SCALES[expert] for expert in env["step_transformers"]]
            assert env["transformer_call"]["guidance_rule_scales"] == scales
        if family == "qwen-image":  # what miles' Qwen-Image collate reads: one text length per sample
            for branch in ("pos_cond_kwargs", "neg_cond_kwargs"):
                kwargs = env[branch]
                assert kwargs["txt_seq_lens"] == [kwargs["encoder_hidden_states"].shape[1]]
                assert len(kwargs["img_shapes"]) == 1
            assert env["pos_cond_kwargs"]["txt_seq_lens"] != env["neg_cond_kwargs"]["txt_seq_lens"]
        if family == "z-image":  # SGLang's caption_valid_lens beside the diffusers call's cap_feats
            assert env["sglang_keys"] == ["caption_valid_lens"]
            for branch in ("pos_cond_kwargs", "neg_cond_kwargs"):
                kwargs = env[branch]
                assert kwargs["caption_valid_lens"].tolist() == [kwargs["cap_feats"].shape[1]]
        if family == "ltx2":
            assert_streams(answer)


def assert_streams(answer: dict) -> None:
    """LTX-2's joint latent cut into its streams as SGLang's multi-stream contract names them: video and
    audio, each [K, *its shape] at latent_step_indices with the whole schedule; the same bytes."""
    trajectory, streams = answer["dit_trajectory"], answer["stream_trajectories"]
    assert list(streams) == ["video", "audio"]
    joint = torch.cat([streams[name]["latents"].flatten(1) for name in streams], dim=1)
    assert torch.equal(joint, trajectory["latents"])
    for stream in streams.values():
        assert torch.equal(stream["latent_step_indices"], trajectory["latent_step_indices"])
        assert torch.equal(stream["timesteps"], trajectory["timesteps"])  # all steps returned: all of them
        assert torch.equal(stream["sigmas"], trajectory["sigmas"])


def test_the_dance_sampler_and_a_used_negative_prompt(sglang, family_resources):
    """rollout_sde_type "dance", as the patched SGLang servers of other trainers take it, with true CFG
    on: the blank negative prompt is then the negative branch's text, and every step replays."""
    body = {**MILES, "prompt": "two cats", "true_cfg_scale": 3.0, "rollout_sde_type": "dance"}
    answers, named = generate(sglang, http_url(family_resources.server("flux")), body)
    assert named == set()
    transformer = family_resources.transformer("flux")
    for answer in answers:
        assert answer["denoising_env"]["neg_cond_kwargs"] is not None
        for i in range(STEPS):
            replayed = replayed_log_prob(transformer, answer, i, "DANCE", constants=True)
            assert abs(replayed - answer["rollout_log_probs"][i].item()) <= TOLERANCE


def test_a_seed_list_in_extra_sampling_params_seeds_each_output(sglang, family_resources):
    """SamplingParams' seed list gives each output its seed: x_0 is the seed's noise, bitwise the same
    as the sample of that seed in a request numbered from a base seed (the noise is drawn per sample
    from its seed alone)."""
    url = http_url(family_resources.server("flux"))
    first_latent = {"rollout_return_step_indices": [0], "num_inference_steps": 2, "true_cfg_scale": 1.0}
    listed, _ = generate(
        sglang,
        url,
        {**MILES, "prompt": "two cats", **first_latent, "extra_sampling_params": {"seed": [43, 42]}},
    )
    numbered, _ = generate(sglang, url, {**MILES, "prompt": "two cats", **first_latent})
    assert [a["seed"] for a in listed] == [43, 42]
    assert torch.equal(listed[0]["dit_trajectory"]["latents"], numbered[1]["dit_trajectory"]["latents"])
    assert torch.equal(listed[1]["dit_trajectory"]["latents"], numbered[0]["dit_trajectory"]["latents"])


def test_ignored_fields_are_named_in_the_header_and_the_log(sglang, family_resources):
    """Keys SGLang's model does not know, its output options, a read-only field set off its default and
    Wan 2.2's fields on a model with one expert are accepted and named, in the header and one log line;
    a key that is no plain name (here one that would forge a header) is counted, not named."""
    server = family_resources.server("flux")
    body = {
        "prompt": "two cats",
        "num_inference_steps": 1,
        "width": 64,
        "height": 64,
        "rollout": False,
        "generator_device": "cpu",
        "trainer_tag": "run-7",
        "x\r\nSet-Cookie: a=b": 1,
        # Output options; and the second expert's fields, which a model with one has no use for.
        "extra_sampling_params": {
            "save_output": False,
            "output_quality": "high",
            "guidance_scale_2": 3.0,
            "boundary_ratio": 0.5,
        },
    }
    answer = post(http_url(server), "/rollout/generate", body)
    assert answer.status_code == 200, answer.text
    expected = (
        "trainer_tag,extra_sampling_params.save_output,extra_sampling_params.output_quality,generator_device,"
        "extra_sampling_params.guidance_scale_2,extra_sampling_params.boundary_ratio,+1 more"
    )
    assert answer.headers[IGNORED_HEADER] == expected
    assert "set-cookie" not in answer.headers
    (decoded,) = msgpack.unpackb(answer.content)
    assert re.search(
        rf"rollout id={decoded['request_id']} over HTTP ignored {re.escape(expected)}\n", server.log()
    )
