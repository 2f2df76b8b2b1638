"""Sampling and stop strings.

Distribution tests draw N = 4,000 tokens with a fixed seed and compare frequencies with the
expected probabilities at an absolute tolerance of 0.035 (over 4 binomial standard deviations
for any p at this N; with a fixed seed the outcome is deterministic anyway). Everything else is
exact."""

from __future__ import annotations

import json
import math
from collections import Counter
from dataclasses import replace

import pytest
import torch

from dsv41.runtime.engine.sampling import (
    SampledToken,
    Sampler,
    SamplingError,
    SamplingParams,
    StopCheck,
    StopMatcher,
    apply_penalties,
    sampling_probs,
)

N = 4_000
TOL = 0.035
PROBS = torch.tensor([0.5, 0.3, 0.15, 0.05])
LOGITS = PROBS.log().float()


def draw(params: SamplingParams, logits=LOGITS, n=N) -> list[float]:
    s = Sampler(params)
    c = Counter(s.sample(logits).token_id for _ in range(n))
    return [c[i] / n for i in range(logits.shape[0])]


def close(freq, want):
    return all(abs(f - w) <= TOL for f, w in zip(freq, want, strict=True))


@pytest.mark.parametrize("field,value,match", [
    ("temperature", -0.1, "temperature must be a number from 0 to 2"),
    ("temperature", 2.5, "temperature"),
    ("temperature", math.nan, "temperature"),
    ("top_p", 0.0, "top_p must be a number above 0"),
    ("top_p", 1.5, "top_p"),
    ("top_k", -1, "top_k must be a whole number"),
    ("top_k", 2.5, "top_k"),
    ("top_k", True, "top_k"),
    ("min_p", 1.1, "min_p"),
    ("presence_penalty", 3.0, "presence_penalty must be a number from -2 to 2"),
    ("frequency_penalty", -2.5, "frequency_penalty"),
    ("repetition_penalty", 0.0, "repetition_penalty must be a number from 0.01 to 100"),
    ("seed", -1, "seed must be a whole number"),
    ("seed", "7", "seed"),
    ("max_tokens", 0, "max_tokens must be a whole number >= 1"),
    ("max_tokens", -5, "max_tokens"),
    ("stop", ("a", ""), "stop strings must not be empty"),
    ("stop", ("a", 3), "stop must be a tuple of strings"),
    ("stop", tuple("abcdefghijklmnopq"), "at most 16"),
    ("stop_token_ids", (1, -2), "stop_token_ids must be token ids"),
    ("stop_token_ids", (600,), "outside the model's 512 token ids"),
    ("ignore_eos", 1, "ignore_eos must be true or false"),
    ("logprobs", 21, "logprobs must be a whole number from 0 to 20"),
])
def test_validate_names_the_bad_field(field, value, match):
    with pytest.raises(ValueError, match=match):
        replace(SamplingParams(), **{field: value}).validate(vocab_size=512)


RP = "repetition_penalty must be a number from 0.01 to 100 (1 turns it off)"


@pytest.mark.parametrize("field,value,message", [
    # issue 38: 5e-324 divides a seen logit to inf (NaN probabilities); 1e300 the same way
    ("repetition_penalty", 5e-324, f"{RP}, not 5e-324."),
    ("repetition_penalty", 0.009, f"{RP}, not 0.009."),
    ("repetition_penalty", 100.5, f"{RP}, not 100.5."),
    ("repetition_penalty", 1e300, f"{RP}, not 1e+300."),
    ("repetition_penalty", math.inf, f"{RP}, not inf."),
    ("repetition_penalty", math.nan, f"{RP}, not nan."),
    # an int too large for a float was an OverflowError (a 500), not a range refusal
    ("repetition_penalty", 10**400, f"{RP}, not {10**400!r}."),
    ("temperature", 10**400, f"temperature must be a number from 0 to 2, not {10**400!r}."),
    ("presence_penalty", -10**400,
     f"presence_penalty must be a number from -2 to 2, not {-10**400!r}."),
    ("min_p", 10**400, f"min_p must be a number from 0 to 1, not {10**400!r}."),
    ("top_p", math.inf, "top_p must be a number above 0 and at most 1, not inf."),
], ids=lambda v: v if isinstance(v, str) and len(v) < 24 else repr(v)[:8])
def test_validate_bounds_every_number_and_says_the_range(field, value, message):
    with pytest.raises(ValueError) as err:
        replace(SamplingParams(), **{field: value}).validate(vocab_size=512)
    assert str(err.value) == message


def test_validate_accepts_the_ends_of_the_ranges():
    for rp in (0.01, 100, 1):
        assert SamplingParams(repetition_penalty=rp).validate(512).repetition_penalty == rp
    p = SamplingParams(temperature=2, top_p=5e-324, min_p=1, presence_penalty=-2,
                       frequency_penalty=2, top_k=10**400, seed=2**63 - 1)
    assert p.validate(512) is p


def test_tiny_temperature_samples_the_argmax():
    """A temperature above 0 but tiny (5e-324 is in OpenAI's [0, 2]) made logits / t inf and
    the distribution NaN; the logits are shifted to a maximum of 0 first, so it is the argmax."""
    for t in (5e-324, 1e-310):
        s = Sampler(SamplingParams(temperature=t, seed=0))
        assert [s.sample(LOGITS).token_id for _ in range(5)] == [0] * 5
    with_penalty = Sampler(SamplingParams(temperature=5e-324, repetition_penalty=100, seed=0))
    assert with_penalty.sample(LOGITS, generated=[0]).token_id == 1


def test_nan_or_posinf_logits_are_refused_not_sampled():
    """NaN (argmax took its index) or +inf (NaN probabilities) in a row of logits: a
    SamplingError, greedy or not."""
    for params in (SamplingParams(temperature=0.0), SamplingParams(seed=0, top_k=2)):
        for bad in (math.nan, math.inf):
            logits = torch.tensor([0.1, bad, 0.2, -math.inf])
            with pytest.raises(SamplingError) as err:
                Sampler(params).sample(logits)
            assert str(err.value) == ("The model's logits hold NaN or +inf values: no token "
                                      "can be sampled from them.")


def test_validate_accepts_good_params():
    p = SamplingParams(temperature=0.7, top_p=0.9, top_k=40, min_p=0.05, presence_penalty=0.5,
                       frequency_penalty=-0.5, repetition_penalty=1.2, seed=3, max_tokens=10,
                       stop=("\n\n",), stop_token_ids=(5,), logprobs=5)
    assert p.validate(vocab_size=512) is p
    assert p.stop_ids(eos_id=1) == {1, 5}
    assert replace(p, ignore_eos=True).stop_ids(eos_id=1) == {5}
    with pytest.raises(ValueError, match="temperature"):
        Sampler(replace(p, temperature=-1.0))


def test_greedy_is_argmax_lowest_id_on_ties():
    s = Sampler(SamplingParams(temperature=0.0))
    assert s.sample(torch.tensor([0.1, 2.0, -1.0, 2.0])).token_id == 1
    assert s.sample(LOGITS).token_id == 0
    assert draw(SamplingParams(temperature=0.0), n=50) == [1.0, 0.0, 0.0, 0.0]


def test_penalties_exact():
    logits = torch.tensor([2.0, -1.0, 0.5, 0.0])
    p = SamplingParams(repetition_penalty=2.0)
    out = apply_penalties(logits, p, generated=[1], prompt=[0])
    assert out.tolist() == [1.0, -2.0, 0.5, 0.0]  # positive / r, negative * r, unseen kept
    p = SamplingParams(presence_penalty=0.5, frequency_penalty=0.25)
    out = apply_penalties(logits, p, generated=[2, 2, 3], prompt=[0])
    assert out.tolist() == [2.0, -1.0, 0.5 - 0.5 - 0.5, 0.0 - 0.5 - 0.25]  # prompt not counted
    # a penalty moves the greedy choice
    s = Sampler(SamplingParams(temperature=0.0, frequency_penalty=2.0))
    assert s.sample(torch.tensor([1.0, 0.5, 0.0]), generated=[0]).token_id == 1


def test_temperature_one_reproduces_the_distribution():
    assert close(draw(SamplingParams(seed=0)), PROBS.tolist())


def test_temperature_scales_the_logits():
    want = torch.softmax(LOGITS.double() / 0.5, 0).tolist()
    assert close(draw(SamplingParams(temperature=0.5, seed=1)), want)
    assert sampling_probs(LOGITS.double(), SamplingParams(temperature=0.5)).tolist() == \
        pytest.approx(want, abs=1e-12)


def test_top_k_top_p_min_p():
    k2 = draw(SamplingParams(top_k=2, seed=2))
    assert k2[2] == k2[3] == 0.0 and close(k2, [0.625, 0.375, 0.0, 0.0])
    # top_p 0.8: 0.5 + 0.3 reaches it, so two tokens; 0.81 needs the third
    assert draw(SamplingParams(top_p=0.8, seed=3))[2:] == [0.0, 0.0]
    p81 = draw(SamplingParams(top_p=0.81, seed=3))
    assert p81[3] == 0.0 and close(p81, [0.5 / 0.95, 0.3 / 0.95, 0.15 / 0.95, 0.0])
    # min_p 0.2: drop below 0.2 * 0.5 = 0.1
    mp = draw(SamplingParams(min_p=0.2, seed=4))
    assert mp[3] == 0.0 and close(mp, [0.5 / 0.95, 0.3 / 0.95, 0.15 / 0.95, 0.0])


def test_seed_reproducible_and_independent_of_other_requests():
    logits = torch.randn(512, generator=torch.Generator().manual_seed(0))
    a, b, c = (Sampler(SamplingParams(seed=s)) for s in (11, 11, 12))
    seq_a = [a.sample(logits).token_id for _ in range(30)]
    seq_b = []
    for _ in range(30):  # another request drawing in between does not disturb b
        c.sample(logits)
        seq_b.append(b.sample(logits).token_id)
    assert seq_a == seq_b
    assert seq_a != [Sampler(SamplingParams(seed=12)).sample(logits).token_id for _ in range(30)]


def test_logprobs_are_the_models():
    logits = torch.tensor([1.0, 3.0, 2.0, 0.0])
    want = torch.log_softmax(logits.double(), 0)
    t = Sampler(SamplingParams(temperature=0.0, logprobs=2, top_k=1)).sample(logits)
    assert isinstance(t, SampledToken) and t.token_id == 1
    assert t.logprob == pytest.approx(float(want[1]), abs=1e-12)
    assert [x.token_id for x in t.top] == [1, 2]
    assert [x.logprob for x in t.top] == pytest.approx([float(want[1]), float(want[2])], abs=1e-12)
    none = Sampler(SamplingParams(temperature=0.0)).sample(logits)
    assert none.logprob is None and none.top == ()
    zero = Sampler(SamplingParams(temperature=0.0, logprobs=0)).sample(logits)
    assert zero.logprob is not None and zero.top == ()


def test_bad_logits_and_ids():
    s = Sampler(SamplingParams(seed=0))
    with pytest.raises(ValueError, match="1-D tensor"):
        s.sample(torch.zeros(2, 4))
    with pytest.raises(ValueError, match="generated ids must lie in 0..3"):
        s.sample(LOGITS, generated=[4])
    with pytest.raises(ValueError, match="prompt ids must lie in 0..3"):
        Sampler(SamplingParams(repetition_penalty=1.1)).sample(LOGITS, prompt=[0, 9])
    with pytest.raises(ValueError, match="no finite value"):
        s.sample(torch.full((4,), -math.inf))


def test_stop_string_across_tokens():
    m = StopMatcher(["\n\n", "END"])
    assert (m.feed("Hello").text, m.feed(" wor").text) == ("Hello", " wor")
    r = m.feed("ld\n")  # "\n" may start "\n\n": held back
    assert (r.text, r.stopped) == ("ld", False)
    r = m.feed("\nmore")
    assert (r.text, r.stopped, r.stop) == ("", True, "\n\n")
    with pytest.raises(ValueError, match="after a stop string matched"):
        m.feed("x")


def test_stop_string_spread_over_three_tokens():
    m = StopMatcher(["STOP"])
    assert m.feed("a ST").text == "a "
    assert m.feed("O").text == ""
    r = m.feed("P?")
    assert (r.text, r.stopped, r.stop) == ("", True, "STOP")


def test_stop_string_false_start_is_released():
    m = StopMatcher(["STOP"])
    assert m.feed("a ST").text == "a "
    assert m.feed("Oo").text == "STOo"
    assert m.feed("S").text == ""
    assert m.flush() == "S"


def test_stop_first_completed_wins_within_one_delta():
    m = StopMatcher(["cd", "bcde"])  # "cd" is complete before "bcde" is, in any stream
    r = m.feed("abcdef")
    assert (r.text, r.stop) == ("ab", "cd")
    m = StopMatcher(["x"])
    r = m.feed("xyz")
    assert (r.text, r.stopped) == ("", True)


@pytest.mark.parametrize("field,value,message", [
    ("repetition_penalty", 5e-324, f"{RP}, not 5e-324."),
    ("temperature", 10**400, f"temperature must be a number from 0 to 2, not {10**400!r}."),
    ("frequency_penalty", math.nan, "frequency_penalty must be a number from -2 to 2, not nan."),
], ids=lambda v: v if isinstance(v, str) and len(v) < 24 else repr(v)[:8])
def test_the_api_answers_an_out_of_range_parameter_with_a_400_naming_it(field, value, message):
    """The body as a JSON client sends it (a 401-digit int, NaN) through the OpenAI parsing:
    a 400 with the parameter and its range, never a 500."""
    from dsv41.graph.config import preset
    from dsv41.graph.vocab import SMALL_STUB_JSON, TokenizerSource
    from dsv41.runtime.serving.openai_api import ApiError, parse_completion
    from dsv41.runtime.serving.tokenizer import Tokenizer

    tok = Tokenizer.from_file(SMALL_STUB_JSON, preset("small"), TokenizerSource.SMALL_STUB)
    body = json.loads(json.dumps({"model": "small", "prompt": [1, 9], field: value}))
    with pytest.raises(ApiError) as err:
        parse_completion(body, tok, model_name="small", vocab_size=512)
    assert (err.value.status, err.value.param, err.value.message) == (400, field, message)


def test_a_stop_string_inside_another_stops_where_it_completes_first_however_the_text_arrives():
    for parts in (["aba"], ["ab", "a"], ["a", "b", "a"]):
        m = StopMatcher(["aba", "b"])
        shown = ""
        for p in parts:
            got = m.feed(p)
            shown += got.text
            if got.stopped:
                break
        assert (shown, got.stopped, got.stop) == ("a", True, "b"), parts
    m = StopMatcher(["xab", "ab"])  # both end at the same place: the longer one
    assert m.feed("zxab") == StopCheck("z", True, "xab")
