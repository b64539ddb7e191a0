"""Explanations against references written out here, in float64, for every formulation: the [CLS] attention from
each layer's logits by definition, rollout by a hand loop, AG-CAM by autograd on an explicit-attention copy of the
model's forward; the localization metrics and the box readers against hand computations and fixtures in ImageNet's
on-disk layouts."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from quest.attention import list_attentions
from quest.explain import agcam, attention_rollout, cls_attention, to_image
from quest.explain.boxes import BoxSource, read_loc_solution, read_voc_xml, resize_boxes, resize_crop_boxes
from quest.explain.localization import boxes_to_mask, localization_scores, map_to_boxes
from quest.models import create_model

from ..reference import reference_logits

FORMULATIONS = list_attentions()


def _model(name: str) -> torch.nn.Module:
    torch.manual_seed(0)
    model = create_model("vit_pico_patch4_16", attention=name, num_classes=10, img_size=16).double().eval()
    with torch.no_grad():  # spread the attention: random weights at init give nearly uniform maps
        for blk in model.blocks:
            blk.attn.qkv.weight.mul_(4.0)
    return model


def _ref_logits(name: str, attn, q, k, v, v_prev):
    """z = the formulation's logits, by definition (tests/reference.py; Elliptical's m by hand)."""
    if name.startswith("elliptical"):
        d = q.shape[-1]
        if v_prev is None:  # the first layer has no m: standard resp. QUEST
            base = "standard" if name == "elliptical" else "quest"
            return reference_logits(base, attn, q, k)
        # mean over tokens of |V_l - V_{l-1}|, per head and dim; a constant to autograd, as the authors compute it
        m = (v.detach() - v_prev.detach()).abs().mean(dim=-2, keepdim=True)
        m = m / m.amax(dim=-1, keepdim=True)
        if name == "elliptical":
            return (q * m) @ k.transpose(-2, -1) / math.sqrt(d)
        return (q * m) @ (k / k.norm(dim=-1, keepdim=True).clamp_min(1e-6)).transpose(-2, -1)
    return reference_logits(name, attn, q, k)


def _explicit_forward(model, images, name, detach=False):
    """The ViT forward with every attention written out: (class logits, per-layer logits, per-layer probs).
    ``detach``: as the AG-CAM authors' ViT_for_AGCAM, each attention block's input is detached."""
    x = model.norm_pre(model._pos_embed(model.patch_embed(images)))
    logits_l, probs_l, v_prev = [], [], None
    for blk in model.blocks:
        attn, h = blk.attn, blk.norm1(x)
        h = h.detach() if detach else h
        B, N, C = h.shape
        q, k, v = attn.qkv(h).reshape(B, N, 3, attn.num_heads, C // attn.num_heads).permute(2, 0, 3, 1, 4)
        z = _ref_logits(name, attn, q, k, v, v_prev)
        p = z.softmax(dim=-1)
        logits_l.append(z)
        probs_l.append(p)
        out = attn.proj((p @ v).transpose(1, 2).reshape(B, N, C))
        x = x + blk.ls1(out)
        x = x + blk.ls2(blk.mlp(blk.norm2(x)))
        v_prev = v
    return model.head(model.norm(x)[:, 0]), logits_l, probs_l


@pytest.mark.parametrize("name", FORMULATIONS)
def test_cls_attention_and_rollout_match_the_written_out_attention(name):
    model, images = _model(name), torch.randn(2, 3, 16, 16, dtype=torch.float64)
    with torch.no_grad():
        out, _, probs = _explicit_forward(model, images, name)
        torch.testing.assert_close(model(images), out, atol=1e-10, rtol=0)  # the copy is the model
    maps = cls_attention(model, images)
    expected = torch.stack([p[:, :, 0, 1:] for p in probs], dim=1).reshape(2, 4, 4, 4, 4)
    torch.testing.assert_close(maps, expected, atol=1e-10, rtol=0)
    rollout = attention_rollout(model, images)
    for b in range(2):  # Abnar & Zuidema: A' = (mean_h A + I) / 2, rows renormalised, multiplied over the layers
        result = torch.eye(17, dtype=torch.float64)
        for p in probs:
            a = p[b].mean(dim=0) + torch.eye(17, dtype=torch.float64)
            a = a / 2
            a = torch.stack([row / row.sum() for row in a])
            result = a @ result
        torch.testing.assert_close(rollout[b], result[0, 1:].reshape(4, 4), atol=1e-10, rtol=0)


@pytest.mark.numerics
@pytest.mark.parametrize("name", FORMULATIONS)
def test_agcam_full_graph_matches_autograd_on_an_explicit_copy(name):
    model, images = _model(name), torch.randn(3, 3, 16, 16, dtype=torch.float64)
    out, logits, probs = _explicit_forward(model, images, name)
    target = out.argmax(dim=1)
    grads = torch.autograd.grad(out.gather(1, target[:, None]).sum(), probs)
    cam = sum((g[:, :, 0, 1:].clamp_min(0) * torch.sigmoid(z[:, :, 0, 1:])).sum(dim=1) for g, z in zip(grads, logits))
    maps, classes = agcam(model, images, gradient="full")
    assert torch.equal(classes, target)  # the predicted class, as the authors' evaluation
    torch.testing.assert_close(maps, cam.reshape(3, 4, 4).detach(), atol=1e-10, rtol=0)
    assert all(p.grad is None for p in model.parameters())  # no parameter gradient is left behind
    other, _ = agcam(model, images, target=[1, 2, 3], gradient="full")  # and for a given class
    assert not torch.allclose(other, maps)


@pytest.mark.numerics
@pytest.mark.parametrize("name", FORMULATIONS)
def test_agcam_detached_is_the_authors_definition(name):
    """The AG-CAM authors' AGCAM.generate on their ViT_for_AGCAM, written out: one image at a time, x.detach() at
    the top of every Attention.forward, backward of output[0, prediction[0]], the gradient at the post-softmax
    attention (their backward hook) and the pre-softmax logits (their forward hook), [CLS] row, ReLU(grad) *
    sigmoid(logits), patch columns, summed over heads and layers."""
    model, images = _model(name), torch.randn(3, 3, 16, 16, dtype=torch.float64)
    expected, predicted = [], []
    for b in range(3):
        out, logits, probs = _explicit_forward(model, images[b:b + 1], name, detach=True)
        prediction = out.argmax(dim=1)
        model.zero_grad()
        grads = torch.autograd.grad(out[0, prediction[0]], probs)
        cam = torch.zeros(16, dtype=torch.float64)
        for g, z in zip(grads, logits):
            cam += (torch.relu(g[0, :, 0, 1:]) * torch.sigmoid(z[0, :, 0, 1:].detach())).sum(dim=0)
        expected.append(cam.reshape(4, 4))
        predicted.append(int(prediction))
    maps, classes = agcam(model, images)  # the authors' gradient is the default
    assert classes.tolist() == predicted
    torch.testing.assert_close(maps, torch.stack(expected), atol=1e-10, rtol=0)
    assert all(p.grad is None for p in model.parameters())
    # the detach changes the maps (4 layers: the later attention layers carry gradient in the full graph)
    full, _ = agcam(model, images, gradient="full")
    assert (full - maps).abs().max() > 1e-3 * maps.abs().max()
    # and a model with frozen weights still has a graph from each layer's attention to the score
    for p in model.parameters():
        p.requires_grad_(False)
    frozen, _ = agcam(model, images)
    torch.testing.assert_close(frozen, maps, atol=1e-12, rtol=0)


def test_agcam_gradient_is_checked():
    model = _model("quest")
    with pytest.raises(ValueError, match="AG-CAM gradient must be one of"):
        agcam(model, torch.randn(1, 3, 16, 16, dtype=torch.float64), gradient="partial")


def test_models_without_a_cls_chain_are_refused_clearly():
    model = create_model("crossvit_tiny_240", attention="quest", num_classes=10)
    with pytest.raises(ValueError, match="CrossViT's two branches"):
        cls_attention(model, torch.randn(1, 3, 240, 240))
    gap = create_model("vit_pico_patch4_16", attention="quest", num_classes=10, global_pool="avg")
    with pytest.raises(ValueError, match=r"does not classify from a \[CLS\] token"):
        agcam(gap, torch.randn(1, 3, 16, 16))


def test_to_image_is_bilinear_then_min_max():
    maps = torch.tensor([[[0.0, 1.0], [2.0, 3.0]]])
    up = torch.nn.functional.interpolate(maps[:, None], size=(4, 4), mode="bilinear", align_corners=False)[:, 0]
    expected = (up - up.min()) / (up.max() - up.min())
    torch.testing.assert_close(to_image(maps, 4), expected)
    assert to_image(torch.ones(1, 2, 2), 4).abs().sum() == 0  # a flat map has no location


# --- localization ------------------------------------------------------------------------------------------------------
def test_map_regions_are_opencvs_contour_boxes():
    cv2 = pytest.importorskip("cv2")
    rng = np.random.default_rng(0)
    for _ in range(20):
        blob = np.zeros((40, 40), dtype=np.float32)
        for _ in range(3):
            x, y, w, h = rng.integers(0, 30, size=2).tolist() + rng.integers(2, 10, size=2).tolist()
            blob[y:y + h, x:x + w] = rng.uniform(0.6, 1.0)
        ours = sorted(map(tuple, map_to_boxes(torch.from_numpy(blob), 0.5).tolist()))
        contours, _ = cv2.findContours((blob > 0.5).astype(np.uint8) * 255, cv2.RETR_EXTERNAL, cv2.CHAIN_APPROX_NONE)
        theirs = sorted((x, y, x + w, y + h) for x, y, w, h in map(cv2.boundingRect, contours))
        assert ours == theirs


def test_localization_scores_by_hand():
    saliency = torch.zeros(10, 10)
    saliency[2:6, 2:6] = 1.0  # one region: box (2, 2, 6, 6), filled inclusive: rows and cols 2..6 = 25 pixels
    true_boxes = np.array([[4, 4, 8, 8]])  # 25 pixels, overlap rows/cols 4..6 = 9 pixels
    s = localization_scores(saliency, true_boxes, threshold=0.5)
    tp, fp, fn, tn, eps = 9, 16, 16, 59, 1e-5
    assert s.pixel_acc == pytest.approx((tp + tn + eps) / (100 + eps))
    assert s.iou == pytest.approx((tp + eps) / (tp + fp + fn + eps)) and s.iou == pytest.approx(9 / 41, rel=1e-4)
    assert s.dice == pytest.approx((2 * tp + eps) / (2 * tp + fp + fn + eps))
    assert s.precision == pytest.approx((tp + eps) / (tp + fp + eps))
    union = boxes_to_mask(np.array([[0, 0, 1, 1], [8, 8, 20, 20]]), (10, 10))
    assert union.sum() == 4 + 4  # clipped to the image


VOC = """<annotation><folder>val</folder><filename>ILSVRC2012_val_00000001</filename>
<size><width>500</width><height>375</height><depth>3</depth></size><segmented>0</segmented>
<object><name>n01751748</name><pose>Unspecified</pose><truncated>0</truncated><difficult>0</difficult>
<bndbox><xmin>111</xmin><ymin>108</ymin><xmax>441</xmax><ymax>331</ymax></bndbox></object>
<object><name>n01751748</name><bndbox><xmin>5</xmin><ymin>6</ymin><xmax>50</xmax><ymax>60</ymax></bndbox></object>
</annotation>"""


def test_boxes_in_both_imagenet_layouts(tmp_path):
    xml_dir = tmp_path / "val"
    xml_dir.mkdir()
    (xml_dir / "ILSVRC2012_val_00000001.xml").write_text(VOC)
    voc = read_voc_xml(xml_dir / "ILSVRC2012_val_00000001.xml")
    assert voc.size == (500, 375) and voc.wnids == ("n01751748", "n01751748")
    np.testing.assert_array_equal(voc.boxes, [[111, 108, 441, 331], [5, 6, 50, 60]])
    csv_path = tmp_path / "LOC_val_solution.csv"
    csv_path.write_text("ImageId,PredictionString\n"
                        "ILSVRC2012_val_00000001,n01751748 111 108 441 331 n01751748 5 6 50 60 \n"
                        "ILSVRC2012_val_00000002,n09193705 0 33 497 374 \n")
    table = read_loc_solution(csv_path)
    np.testing.assert_array_equal(table["ILSVRC2012_val_00000001"].boxes, voc.boxes)
    for source in (BoxSource(xml_dir), BoxSource(csv_path)):
        np.testing.assert_array_equal(source("ILSVRC2012_val_00000001").boxes, voc.boxes)
    with pytest.raises(FileNotFoundError, match="LOC_val_solution.csv"):
        BoxSource(tmp_path / "missing")
    bad = tmp_path / "bad.csv"
    bad.write_text("id,boxes\nx,1 2 3\n")
    with pytest.raises(ValueError, match="ImageId,PredictionString"):
        read_loc_solution(bad)


def test_boxes_follow_the_image_through_resize_and_crop():
    from PIL import Image
    from torchvision import transforms as T

    # the authors' Resize((224, 224)): int(x / width * 224)
    np.testing.assert_array_equal(resize_boxes(np.array([[111, 108, 441, 331]]), (500, 375), 224),
                                  [[int(111 / 500 * 224), int(108 / 375 * 224), int(441 / 500 * 224),
                                    int(331 / 375 * 224)]])
    # timm's eval transform: the box drawn into an image goes through torchvision's Resize + CenterCrop
    for (w, h), box in (((500, 375), (111, 108, 441, 331)), ((300, 500), (20, 300, 280, 490))):
        img = Image.new("L", (w, h), 0)
        img.paste(255, (box[0], box[1], box[2] + 1, box[3] + 1))
        crop = np.asarray(T.Compose([T.Resize(int(224 / 0.875), interpolation=T.InterpolationMode.NEAREST),
                                     T.CenterCrop(224)])(img)) > 127
        rows, cols = np.nonzero(crop)
        expected = [cols.min(), rows.min(), cols.max(), rows.max()]
        got = resize_crop_boxes(np.array([box]), (w, h), 224, 0.875)[0]
        assert np.abs(got - np.array(expected)).max() <= 1, (got, expected)
