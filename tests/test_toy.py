"""The toy study: the data generator's statistics, the model, batched == one-by-one training, outcomes, the CLI."""
from __future__ import annotations

import csv
import math
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from timm.models.vision_transformer import Block

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
from quest.toy.config import OutcomeRules

from .helpers import ROOT

PAPER_SIX = ["standard", "quest", "qnorm", "qknorm", "qknorm_hs", "qknorm_ds"]


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
    with pytest.raises(ValueError, match="biased_fraction must lie in"):
        ToyDataConfig(biased_fraction=1.5)
    with pytest.raises(ValueError, match="train_size must be a positive integer"):
        ToyDataConfig(train_size=0)


# --- model -------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("attention", PAPER_SIX)
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


# --- batched training ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("attention", ["standard", "quest", "qknorm_hs", "qknorm_ds"])
def test_batched_runs_equal_runs_trained_one_by_one(attention):
    cfg = ToyDataConfig(train_size=96, test_size=64)
    data = make_toy_data(cfg, seed=5)
    kwargs = dict(seq_len=cfg.seq_len, dim=cfg.dim, num_classes=cfg.num_classes)
    runs = [RunSpec(1e-2, 0.0, 0), RunSpec(5e-3, 0.1, 1), RunSpec(2.5e-3, 0.05, 0)]
    res = train_chunk(attention, runs, data.train, data.test, data_seed=5, epochs=3, batch_size=32,
                      model_kwargs=kwargs)
    for i, run in enumerate(runs):
        torch.manual_seed(run.init_seed)
        model = ToyTransformer(attention, **kwargs)
        opt = torch.optim.AdamW(model.parameters(), lr=run.lr, weight_decay=run.weight_decay)
        for epoch in range(3):
            for idx in batch_order(5, epoch, 96, 32):
                opt.zero_grad()
                F.cross_entropy(model(data.train.x[idx]), data.train.y[idx]).backward()
                opt.step()
        for name, p in model.named_parameters():
            got, want = res.weights[name][i], p.detach()
            if name in ("attn.qkv.bias", "attn.k_norm.bias"):
                # a bias added to every key shifts a softmax row by a constant: its exact gradient is 0, so Adam
                # turns float noise into +-lr steps in both versions; it cannot change the output (checked below)
                got, want = (torch.cat([got[:20], got[40:]]), torch.cat([want[:20], want[40:]])) \
                    if name == "attn.qkv.bias" else (got[:0], want[:0])
            torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4, msg=name)
        batched = ToyTransformer(attention, **kwargs)
        batched.load_state_dict({k: v[i] for k, v in res.weights.items()})
        with torch.no_grad():
            torch.testing.assert_close(batched(data.test.x), model(data.test.x), atol=1e-4, rtol=1e-4)
        with torch.no_grad():
            train_acc = (model(data.train.x).argmax(-1) == data.train.y).float().mean()
            test_acc = (model(data.test.x).argmax(-1) == data.test.y).float().mean()
            loss = F.cross_entropy(model(data.train.x), data.train.y)
        assert res.train_acc[i] == pytest.approx(train_acc.item())
        assert res.test_acc[i] == pytest.approx(test_acc.item())
        assert res.final_loss[i] == pytest.approx(loss.item(), rel=1e-4)
    assert res.key_norms.shape == (3, 4, 3)
    assert not torch.equal(res.weights["head.weight"][0], res.weights["head.weight"][1])


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


def test_success_rates_per_cell_and_overall():
    rows = [{"attention": "quest", "lr": 1e-3, "weight_decay": 0.0, "outcome": o}
            for o in ("correct", "correct", "biased", "degenerate")]
    rows += [{"attention": "quest", "lr": 1e-2, "weight_decay": 0.0, "outcome": "correct"}]
    rates = {(r["lr"], r["weight_decay"]): r for r in success_rates(rows)}
    assert rates[(1e-3, 0.0)]["success_rate"] == 0.5
    assert rates[(1e-3, 0.0)]["biased"] == 1 and rates[(1e-3, 0.0)]["runs"] == 4
    assert rates[("all", "all")]["success_rate"] == pytest.approx(3 / 5)
    assert set(OUTCOMES) <= set(rates[("all", "all")])


# --- the command line ----------------------------------------------------------------------------------------------
TINY = ["grid=quick", "grid.lrs=[0.01]", "grid.weight_decays=[0.0,0.1]", "grid.data_seeds=[0]", "grid.init_seeds=[0,1]",
        "data.train_size=64", "data.test_size=64", "train.epochs=2", "probe_size=32"]


def _toy(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "quest.toy", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=600)


def test_cli_writes_outputs_and_resumes(tmp_path):
    out = tmp_path / "toy"
    proc = _toy(*TINY, "attentions=[standard,quest]", f"out_dir={out}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = list(csv.DictReader((out / "runs.csv").open()))
    assert len(rows) == 2 * 2 * 2
    assert set(rows[0]) == {"attention", "lr", "weight_decay", "data_seed", "init_seed", "train_acc", "test_acc",
                            "final_train_loss", "outcome"}
    assert {r["outcome"] for r in rows} <= set(OUTCOMES)
    rates = list(csv.DictReader((out / "success_rates.csv").open()))
    assert {(r["attention"], r["lr"]) for r in rates} == {(a, lr) for a in ("standard", "quest") for lr in ("all", "0.01")}
    for png in ("success_heatmaps.png", "key_norms.png"):
        assert (out / png).stat().st_size > 10_000
    norms = torch.load(out / "key_norms.pt", weights_only=True)
    assert norms["quest"].shape == (4, 3, 3)  # runs, epochs + 1, token groups
    # a rerun finds every chunk done and reproduces the same table without training
    before = (out / "runs.csv").read_text()
    again = _toy(*TINY, "attentions=[standard,quest]", f"out_dir={out}")
    assert again.returncode == 0 and "skipped" in again.stdout + again.stderr
    assert (out / "runs.csv").read_text() == before
    # the same directory with a different config is refused, not mixed
    other = _toy(*TINY, "attentions=[standard,quest]", "train.epochs=3", f"out_dir={out}")
    assert other.returncode != 0 and "different toy config" in other.stdout + other.stderr


def test_cli_rejects_an_unknown_attention(tmp_path):
    proc = _toy(*TINY, "attentions=[standard,nope]", f"out_dir={tmp_path}")
    assert proc.returncode != 0 and "['nope'] not usable" in proc.stdout + proc.stderr


@pytest.mark.slow
def test_quick_grid_runs_every_formulation(tmp_path):
    proc = _toy("grid=quick", f"out_dir={tmp_path}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = list(csv.DictReader((tmp_path / "runs.csv").open()))
    assert sorted({r["attention"] for r in rows}) == sorted(PAPER_SIX)
    assert len(rows) == 6 * 16
