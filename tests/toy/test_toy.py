"""The toy study: the data generator's statistics, the model, the engine == runs trained one by one with
torch.optim.AdamW, outcomes under both rule sets, the stopping rule. The command line: tests/toy/test_toy_cli.py."""
from __future__ import annotations

import math
import subprocess

import pytest
import torch
import torch.nn.functional as F
from timm.models.vision_transformer import Block

from quest.attention import list_attentions
from quest.toy import (
    OUTCOMES,
    RunSpec,
    ToyDataConfig,
    ToyTransformer,
    batch_order,
    classify,
    make_toy_data,
    success_rates,
    train_chunk,
)
from quest.toy.batched import _program
from quest.toy.config import OutcomeRules, PaperOutcomeRules, StopRule
from quest.toy.outcomes import PAPER_OUTCOMES, classify_paper, stop_size, wilson_interval

ALL = list_attentions()  # every registered one: a new formulation is tested here without being listed


# --- data --------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def big_data():
    return make_toy_data(ToyDataConfig(train_size=20_000, test_size=4_000), seed=3)


def test_answer_position_is_rounded_normal(big_data):
    pos = big_data.train.answer_pos.double()
    assert abs(pos.mean() - 10) < 0.05 and abs(pos.std() - 2) < 0.05
    # P(round(N(10, 2)) = 10) = P(9.5 < X < 10.5) = 0.197 ("about 20% of the time", A.3)
    p10 = 0.5 * (math.erf(0.25 / math.sqrt(2)) - math.erf(-0.25 / math.sqrt(2)))
    assert abs((pos == 10).double().mean() - p10) < 0.01


def test_label_is_the_one_hot_at_the_answer_position(big_data):
    tr = big_data.train
    one_hot = tr.x[torch.arange(len(tr.y)), tr.answer_pos, 10:]
    assert torch.equal(one_hot.argmax(-1), tr.y)
    assert torch.equal(tr.x[..., 10:].sum(-1), torch.ones(tr.x.shape[:2]))  # every token has a one-hot part


def test_biased_share_and_shared_bias_vector(big_data):
    tr, n = big_data.train, 20_000
    share = tr.biased.double().mean()
    assert abs(share - 0.5) < 4 * math.sqrt(0.25 / n)  # Bernoulli(0.5), 4 standard errors
    answers = tr.x[torch.arange(n), tr.answer_pos, :10]
    biased = answers[tr.biased]
    # every biased answer token is b + N(0, 0.1 I): one vector shared by all of them
    assert torch.allclose(biased.mean(0), big_data.bias, atol=0.02)
    assert torch.allclose(biased.var(0), torch.full((10,), 0.1), atol=0.01)
    # unbiased answer tokens ~ N(0, S S^T), Sigma != I
    sigma = big_data.sigma_factor @ big_data.sigma_factor.T
    unbiased = answers[~tr.biased]
    cov = torch.cov(unbiased.T)
    assert torch.allclose(cov, sigma, atol=0.1 * sigma.abs().max())
    assert not torch.allclose(sigma, torch.eye(10), atol=0.5)
    # every other token ~ N(0, I)
    other = torch.ones(tr.x.shape[:2], dtype=torch.bool)
    other[torch.arange(n), tr.answer_pos] = False
    rest = tr.x[..., :10][other]
    assert abs(rest.mean()) < 0.01 and abs(rest.var() - 1) < 0.01


def test_test_set_carries_no_bias_by_default_and_seeds_differ(big_data):
    assert not big_data.test.biased.any()
    again = make_toy_data(ToyDataConfig(train_size=20_000, test_size=4_000), seed=3)
    assert torch.equal(again.train.x, big_data.train.x)
    other = make_toy_data(ToyDataConfig(train_size=20_000, test_size=4_000), seed=4)
    assert not torch.equal(other.bias, big_data.bias)
    with_bias = make_toy_data(ToyDataConfig(train_size=10, test_size=4_000, test_biased_fraction=1.0), seed=3)
    assert with_bias.test.biased.all()


def test_bad_data_config_is_refused():
    with pytest.raises(ValueError, match=r"biased_fraction must be in \[0, 1\]"):
        ToyDataConfig(biased_fraction=1.5)
    for size in (0, 2**20 + 1, 10**20):  # 10**20: past what torch indexes
        with pytest.raises(ValueError, match=r"train_size must be an integer in 1\.\.1048576"):
            ToyDataConfig(train_size=size)


# --- model -------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("attention", ALL)
def test_cls_row_forward_equals_a_full_timm_block(attention):
    """The model computes only the [CLS] row; a full timm Block (SDPA, every row) must give the same output."""
    torch.manual_seed(1)
    model = ToyTransformer(attention, seq_len=20, dim=20, num_classes=10).double()
    with torch.no_grad():  # move every parameter off its initial value so nothing is trivially equal
        for p in model.parameters():
            p.add_(0.3 * torch.randn_like(p))
    block = Block(20, num_heads=1, mlp_ratio=1.0, qkv_bias=True, attn_layer=type(model.attn)).double()
    block.norm1, block.attn, block.norm2, block.mlp = model.norm1, model.attn, model.norm2, model.mlp
    x = make_toy_data(ToyDataConfig(train_size=16, test_size=1), seed=0).train.x.double()
    tokens = torch.cat([model.cls_token.expand(16, 1, 20), x], 1) + model.pos_embed
    expected = model.head(model.norm(block(tokens)[:, 0]))
    torch.testing.assert_close(model(x), expected, atol=1e-10, rtol=1e-10)


def test_qknorm_scale_uses_the_toy_sequence_length():
    model = ToyTransformer("qknorm", seq_len=20, dim=20, num_classes=10)
    assert model.attn.qk_scale.item() == pytest.approx(math.log2(21**2 - 21))


# --- the engine ----------------------------------------------------------------------------------------------------
KW = dict(seq_len=20, dim=20, num_classes=10)


def _perturbed(attention: str, seed: int) -> ToyTransformer:
    torch.manual_seed(seed)
    model = ToyTransformer(attention, **KW).double()
    with torch.no_grad():  # every parameter off its initial value (LayerNorm gains != 1, biases != 0, ...)
        for p in model.parameters():
            p.add_(0.3 * torch.randn_like(p))
    return model


@pytest.mark.parametrize("attention", ALL)
def test_engine_logits_equal_each_model_s_forward(attention):
    """The engine's own batched forward (keys from the shared centred input, values never formed) computes exactly
    ToyTransformer's function, run by run, for every formulation (its transform_qk under vmap)."""
    models = [_perturbed(attention, s) for s in range(3)]
    prog = _program(attention, KW, False, (0.9, 0.999), 1e-8)
    w = prog.layout.stack(models)
    x = make_toy_data(ToyDataConfig(train_size=16, test_size=1), seed=0).train.x.double()
    with torch.no_grad():
        got = prog.logits(w, x)
        for i, m in enumerate(models):
            torch.testing.assert_close(got[i], m(x), atol=1e-12, rtol=1e-12)
            keys, _ = m.keys(x)
            torch.testing.assert_close(prog.key_norms(w, x)[i], keys.norm(dim=-1), atol=1e-12, rtol=1e-12)


def _one_by_one(attention, run, data, epochs, dtype, frozen=(), param_init=None):
    """The reference: one ToyTransformer trained alone with torch.optim.AdamW."""
    torch.manual_seed(run.init_seed)
    model = ToyTransformer(attention, **KW)
    for name, value in (param_init or {}).items():
        with torch.no_grad():
            model.get_parameter(name).fill_(value)
    model = model.to(dtype)
    params = [p for n, p in model.named_parameters() if n not in frozen]
    opt = torch.optim.AdamW(params, lr=run.lr, weight_decay=run.weight_decay)
    n = len(data.train.y)
    for epoch in range(epochs):
        for idx in batch_order(5, epoch, n, 32):
            opt.zero_grad()
            F.cross_entropy(model(data.train.x[idx].to(dtype)), data.train.y[idx]).backward()
            opt.step()
    return model


RUNS = [RunSpec(1e-2, 0.0, 0), RunSpec(5e-3, 0.1, 1), RunSpec(2.5e-3, 0.05, 0)]


@pytest.mark.parametrize("attention", ALL)
def test_engine_equals_runs_trained_one_by_one_with_adamw(attention):
    """float64, so that nothing hides in the tolerance: every parameter of every run to 1e-9 after 9 steps
    (tiles of 2 runs: 2 + 1, so the tiling is exercised too), and the reported accuracies and loss exactly."""
    data = make_toy_data(ToyDataConfig(train_size=96, test_size=64), seed=5)
    res = train_chunk(attention, RUNS, data.train, data.test, data_seed=5, epochs=3, batch_size=32, model_kwargs=KW,
                      runs_per_call=2, dtype=torch.float64)
    for i, run in enumerate(RUNS):
        model = _one_by_one(attention, run, data, 3, torch.float64)
        for name, p in model.named_parameters():
            torch.testing.assert_close(res.weights[name][i], p.detach(), atol=1e-9, rtol=1e-9, msg=name)
        with torch.no_grad():
            for split, got in ((data.train, res.train_acc[i]), (data.test, res.test_acc[i])):
                want = (model(split.x.double()).argmax(-1) == split.y).double().mean().item()
                assert got.item() == pytest.approx(want, abs=1e-6)  # the same samples right (1 sample: 0.01)
            loss = F.cross_entropy(model(data.train.x.double()), data.train.y)
        assert res.final_loss[i].item() == pytest.approx(loss.item(), rel=1e-9)
    assert res.key_norms.shape == (3, 4, 3)
    assert not torch.equal(res.weights["head.weight"][0], res.weights["head.weight"][1])


def test_compiled_engine_equals_runs_trained_one_by_one_with_adamw():
    """The study's compiled step (torch.compile, on a CPU with inductor's C++ wrapper) trains as the eager one: every
    parameter of every run against torch.optim.AdamW run by run, float64, after 9 steps. It hands the new weights back
    the way this torch gets (quest/toy/compiled.py, UPDATES_IN_PLACE): written in the graph on CI's newest set,
    returned in its floor phase (torch 2.8)."""
    data = make_toy_data(ToyDataConfig(train_size=96, test_size=64), seed=5)
    res = train_chunk("quest", RUNS, data.train, data.test, data_seed=5, epochs=3, batch_size=32, model_kwargs=KW,
                      dtype=torch.float64, compile=True)
    for i, run in enumerate(RUNS):
        model = _one_by_one("quest", run, data, 3, torch.float64)
        for name, p in model.named_parameters():
            torch.testing.assert_close(res.weights[name][i], p.detach(), atol=1e-8, rtol=1e-8, msg=name)


@pytest.mark.parametrize("banner, version, trusted", [
    ("g++ (Debian 12.2.0-14+deb12u1) 12.2.0", "12.2.0", True),
    ("g++ (GCC) 11.4.1 20231218 (Red Hat 11.4.1-3)", "11.4.1", True),
    ("g++ (GCC) 10.2.1 20210130 (Red Hat 10.2.1-11)", "10.2.1", False),  # no AMX flags before g++ 11
    ("Ubuntu clang version 17.0.6", "17.0.6", False),
    (None, None, False),  # no compiler at all
])
def test_compile_options_trust_the_cpu_flags_only_with_a_recent_gcc(monkeypatch, banner, version, trusted):
    """The ISA probes are skipped (cpp.vec_isa_ok) only where the compiler is g++ 11+; elsewhere inductor probes."""
    import quest.toy.compiled as compiled

    def run(cmd, **kwargs):
        if banner is None:
            raise FileNotFoundError(cmd[0])
        return subprocess.CompletedProcess(cmd, 0, stdout=banner + "\n" if "--version" in cmd else version + "\n")

    monkeypatch.setattr(compiled.subprocess, "run", run)
    monkeypatch.setattr(compiled.platform, "machine", lambda: "x86_64")
    monkeypatch.delenv("ATEN_CPU_CAPABILITY", raising=False)  # the test's own: a capped shell must not decide it
    compiled._gcc_has_every_x86_isa.cache_clear()
    try:
        options = compiled.compile_options("cpu")
        assert options["cpp_wrapper"] and options["cpp_cache_precompile_headers"] is False
        assert options.get("cpp.vec_isa_ok", False) is trusted
        monkeypatch.setenv("ATEN_CPU_CAPABILITY", "default")  # capped kernels: the CPU's flags say nothing then
        assert "cpp.vec_isa_ok" not in compiled.compile_options("cpu")
        monkeypatch.delenv("ATEN_CPU_CAPABILITY")
        assert compiled.compile_options("cuda") == {}
        monkeypatch.setattr(compiled.platform, "machine", lambda: "aarch64")
        compiled._gcc_has_every_x86_isa.cache_clear()
        assert "cpp.vec_isa_ok" not in compiled.compile_options("cpu")  # only x86's ISAs are known to g++ 11
    finally:
        compiled._gcc_has_every_x86_isa.cache_clear()


@pytest.mark.parametrize("attention", ["standard", "quest"])
def test_engine_in_float32_matches_one_by_one_training(attention):
    """The study's precision: the trained functions agree (a few parameters with an exactly-zero gradient, e.g. the
    key bias, take Adam steps of float noise in both versions, so the comparison is of outputs)."""
    data = make_toy_data(ToyDataConfig(train_size=96, test_size=64), seed=5)
    res = train_chunk(attention, RUNS, data.train, data.test, data_seed=5, epochs=3, batch_size=32, model_kwargs=KW)
    for i, run in enumerate(RUNS):
        model = _one_by_one(attention, run, data, 3, torch.float32)
        trained = ToyTransformer(attention, **KW)
        trained.load_state_dict({k: v[i] for k, v in res.weights.items()})
        with torch.no_grad():
            torch.testing.assert_close(trained(data.test.x), model(data.test.x), atol=1e-3, rtol=1e-3)


def test_frozen_and_initialised_parameters():
    """QKNorm with g fixed at 1/sqrt(d): g never moves, and the rest trains as torch.optim.AdamW without g."""
    data = make_toy_data(ToyDataConfig(train_size=64, test_size=32), seed=5)
    init = {"attn.qk_scale": 20**-0.5}
    res = train_chunk("qknorm", RUNS[:2], data.train, data.test, data_seed=5, epochs=2, batch_size=32,
                      model_kwargs=KW, dtype=torch.float64, param_init=init, frozen=["attn.qk_scale"])
    assert torch.equal(res.weights["attn.qk_scale"], torch.full((2, 1), 20**-0.5).double())  # set in float32
    for i, run in enumerate(RUNS[:2]):
        model = _one_by_one("qknorm", run, data, 2, torch.float64, frozen=["attn.qk_scale"], param_init=init)
        for name, p in model.named_parameters():
            torch.testing.assert_close(res.weights[name][i], p.detach(), atol=1e-9, rtol=1e-9, msg=name)
    with pytest.raises(ValueError, match="cannot freeze"):
        train_chunk("standard", RUNS[:1], data.train, data.test, 5, 1, 32, KW, frozen=["attn.qk_scale"])
    with pytest.raises(ValueError, match="no parameter 'attn.qk_scale'"):
        train_chunk("standard", RUNS[:1], data.train, data.test, 5, 1, 32, KW, param_init=init)


def test_tiles_and_extra_test_sets():
    """Training in tiles of 1, 2 or all runs gives the same runs; every named test set is evaluated."""
    data = make_toy_data(ToyDataConfig(train_size=64, test_size=32), seed=5)
    biased = make_toy_data(ToyDataConfig(train_size=64, test_size=32, test_biased_fraction=0.5), seed=5)
    assert torch.equal(biased.train.x, data.train.x)  # the training set does not depend on the test set's make-up
    results = [train_chunk("quest", RUNS, data.train, {"test": data.test, "biased": biased.test}, 5, 2, 32, KW,
                           runs_per_call=n, dtype=torch.float64, probe_size=0) for n in (1, 2, 3)]
    for res in results[1:]:
        for name, w in res.weights.items():
            torch.testing.assert_close(w, results[0].weights[name], atol=1e-12, rtol=1e-12)
    res = results[0]
    assert set(res.test_accs) == {"test", "biased"} and torch.equal(res.test_acc, res.test_accs["test"])
    assert res.key_norms.shape == (3, 0, 3)
    model = ToyTransformer("quest", **KW).double()
    model.load_state_dict({k: v[1] for k, v in res.weights.items()})
    with torch.no_grad():
        acc = (model(biased.test.x.double()).argmax(-1) == biased.test.y).double().mean()
    assert res.test_accs["biased"][1].item() == pytest.approx(acc.item(), abs=1e-6)


def test_device_placement_on_cpu():
    """device= reaches every tensor the engine makes (here the CPU, given as a torch.device); results come back on the
    CPU; a CUDA device without CUDA is refused before anything trains."""
    data = make_toy_data(ToyDataConfig(train_size=32, test_size=16), seed=1)
    res = train_chunk("quest", RUNS[:2], data.train, data.test, 1, 1, 32, KW, device=torch.device("cpu"))
    assert all(t.device.type == "cpu" for t in (res.train_acc, res.test_acc, res.key_norms, *res.weights.values()))
    from quest.toy.study import _check

    cfg = {"attentions": ["quest"], "grid": {"lrs": [1e-3], "weight_decays": [0.0], "data_seeds": [0],
                                             "init_seeds": [0]}, "study": {"name": "grid"}, "device": "cuda:0"}
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="no CUDA device"):
            _check(cfg)


@pytest.mark.cuda  # tests/conftest.py: only under QUEST_TEST_GPU=1, on a machine with CUDA
def test_engine_on_cuda_matches_cpu():
    data = make_toy_data(ToyDataConfig(train_size=64, test_size=32), seed=5)
    cpu = train_chunk("quest", RUNS, data.train, data.test, 5, 2, 32, KW, dtype=torch.float64)
    gpu = train_chunk("quest", RUNS, data.train, data.test, 5, 2, 32, KW, dtype=torch.float64, device="cuda")
    for name, w in cpu.weights.items():
        torch.testing.assert_close(gpu.weights[name], w, atol=1e-9, rtol=1e-9)


def test_batch_order_covers_the_set_once_per_epoch_and_depends_on_epoch():
    batches = batch_order(2, 0, 100, 32)
    assert [len(b) for b in batches] == [32, 32, 32, 4]
    assert torch.equal(torch.cat(batches).sort().values, torch.arange(100))
    assert not torch.equal(torch.cat(batches), torch.cat(batch_order(2, 1, 100, 32)))


# --- outcomes ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("train_acc, test_acc, expected", [
    (1.0, 0.95, "correct"), (0.92, 0.91, "correct"),
    (0.11, 0.09, "degenerate"), (0.2, 0.15, "degenerate"), (0.28, 0.12, "degenerate"),
    (0.65, 0.30, "biased"), (0.80, 0.20, "biased"), (0.50, 0.40, "biased"),
    (0.95, 0.85, "other"),  # nearly correct: no rule of the paper
    (0.35, 0.10, "other"),  # learned little
    (0.88, 0.60, "other"),
])
def test_outcome_classifier(train_acc, test_acc, expected):
    assert classify(train_acc, test_acc, OutcomeRules()) == expected


@pytest.mark.parametrize("train_acc, test_acc, expected", [
    (0.95, 0.93, "correct"), (0.90, 0.95, "unclassified"),  # "> 90%": 90% itself is not correct
    (0.5, 0.2, "biased"), (0.8, 0.4, "biased"), (0.7, 0.3, "biased"),
    (0.85, 0.3, "unclassified"), (0.7, 0.12, "unclassified"),  # train above 80% / test at chance: no range
    (0.12, 0.09, "degenerate"), (0.15, 0.15, "degenerate"), (0.25, 0.1, "unclassified"),
])
def test_paper_outcome_ranges(train_acc, test_acc, expected):
    assert classify_paper(train_acc, test_acc, PaperOutcomeRules()) == expected
    assert expected in PAPER_OUTCOMES


def test_success_rates_per_cell_and_overall():
    rows = [{"attention": "quest", "lr": 1e-3, "weight_decay": 0.0, "outcome": o}
            for o in ("correct", "correct", "biased", "degenerate")]
    rows += [{"attention": "quest", "lr": 1e-2, "weight_decay": 0.0, "outcome": "correct"}]
    rates = {(r["lr"], r["weight_decay"]): r for r in success_rates(rows)}
    assert rates[(1e-3, 0.0)]["success_rate"] == 0.5
    assert rates[(1e-3, 0.0)]["biased"] == 1 and rates[(1e-3, 0.0)]["runs"] == 4
    assert rates[("all", "all")]["success_rate"] == pytest.approx(3 / 5)
    assert set(OUTCOMES) <= set(rates[("all", "all")])


def test_wilson_interval_matches_known_values():
    # Wilson score intervals (z = 1.96), e.g. Brown, Cai & DasGupta (2001): 5 / 10 -> (0.2366, 0.7634)
    assert wilson_interval(5, 10) == pytest.approx((0.23659, 0.76341), abs=1e-5)
    assert wilson_interval(0, 20) == pytest.approx((0.0, 0.16113), abs=1e-5)
    assert wilson_interval(48, 48) == pytest.approx((0.92590, 1.0), abs=1e-5)


def test_stop_size_rule():
    def table(rates):  # rates: {size: {attention: correct of 96}}
        return [{"axis": "train_size", "attention": a, "train_size": n, "correct": k, "runs": 96}
                for n, per in rates.items() for a, k in per.items()]

    rule = StopRule(min_points=5.0, z=2.0)
    # 10 -> 40 of 96 is far beyond noise; 40 -> 45 -> 44 is within it
    got = stop_size(table({768: {"a": 10, "b": 5}, 2048: {"a": 40, "b": 30}, 4096: {"a": 45, "b": 33},
                           8192: {"a": 44, "b": 36}}), ["a", "b"], [768, 2048, 4096, 8192], rule)
    assert got["size"] == 2048 and got["converged"]
    assert [s["stable"] for s in got["steps"]] == [False, True, True]
    # one formulation still rising at every step: the largest size, not converged
    got = stop_size(table({768: {"a": 0}, 2048: {"a": 30}, 4096: {"a": 60}, 8192: {"a": 90}}), ["a"],
                    [768, 2048, 4096, 8192], rule)
    assert got["size"] == 8192 and not got["converged"]
    # 2 standard errors of 48/96 vs 63/96 (pooled p = 0.578): 0.1426 -> a 15.6-point change is not stable
    got = stop_size(table({1: {"a": 48}, 2: {"a": 63}}), ["a"], [1, 2], rule)
    assert got["steps"][0]["checks"][0]["allowed"] == pytest.approx(0.1426, abs=1e-4) and not got["converged"]
