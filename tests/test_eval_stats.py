"""The shapes eval's statistics against their formulas: the standard error with a prompt's images one
cluster, and the paired before/after difference."""

import math

import numpy as np
import pytest

from rollout_client.shapes_eval import clustered_standard_error, paired_difference

PROMPTS = [p for p in ("a", "b", "c", "d") for _ in range(4)]  # 4 prompts x 4 seeds


def test_the_standard_error_counts_a_prompts_images_as_one_cluster():
    before = [True] * 4 + [False] * 4 + [True, False, True, False] + [False] * 4
    means = np.array([1.0, 0.0, 0.5, 0.0])
    expected = means.std(ddof=1) / math.sqrt(4)
    assert clustered_standard_error([float(c) for c in before], PROMPTS) == pytest.approx(expected, rel=1e-12)
    # It is larger than the independent-images formula here: the prompts differ more than the seeds.
    p = sum(before) / 16
    assert expected > math.sqrt(p * (1 - p) / 16)
    assert math.isnan(clustered_standard_error([1.0, 0.0], ["a", "a"]))


def test_the_paired_difference_is_the_mean_per_image_change_with_its_clustered_error():
    before = [False] * 16
    after = [True, True, False, False] + [False] * 4 + [True] * 4 + [True, False, False, False]
    paired = paired_difference(before, after, PROMPTS, PROMPTS)
    assert paired["before"] == 0 and paired["after"] == paired["difference"] == 7 / 16
    changes = np.array([0.5, 0.0, 1.0, 0.25])
    assert paired["se"] == pytest.approx(changes.std(ddof=1) / 2, rel=1e-12)
    assert (paired["images"], paired["prompts"]) == (16, 4)
    with pytest.raises(ValueError, match="do not pair"):
        paired_difference(before, after, PROMPTS, PROMPTS[::-1])
