import pytest
import torch

from gem_kunlun import BaselineConfig, BaselineRanker, multitask_loss
from gem_kunlun.testing import SPEC, random_batch
from gem_transfer import DistilledStudent, StudentAdapter, soft_label_loss


def test_soft_label_loss_is_zero_at_the_teacher_and_positive_elsewhere():
    teacher = torch.randn(32, 2)
    assert soft_label_loss(teacher.clone(), teacher).item() == pytest.approx(0.0, abs=1e-6)
    assert soft_label_loss(teacher + 0.5, teacher).item() > 0
    # the temperature softens targets; T^2 keeps the size of the gradient comparable
    student = torch.zeros(32, 2, requires_grad=True)
    soft_label_loss(student, teacher, temperature=2.0).backward()
    assert torch.isfinite(student.grad).all()
    with pytest.raises(ValueError, match="temperature"):
        soft_label_loss(teacher, teacher, temperature=0.0)
    with pytest.raises(ValueError, match="same shape"):
        soft_label_loss(teacher[:, :1], teacher)


def test_soft_label_loss_is_the_cross_entropy_against_the_teachers_probabilities_without_the_probability_form(monkeypatch):
    """BCE(sigmoid(s / T), p) - H(p) for p = sigmoid(t / T), x T^2; computed from logits only: CUDA autocast refuses
    F.binary_cross_entropy (the trainer runs the student's loss under it)."""
    import torch.nn.functional as F

    student, teacher = torch.randn(64, 2) * 3, torch.randn(64, 2) * 3
    p, q = torch.sigmoid(teacher.double() / 2), torch.sigmoid(student.double() / 2)
    expected = (-(p * q.log() + (1 - p) * (1 - q).log()) + (p * p.log() + (1 - p) * (1 - p).log())).mean() * 4

    def refused(*args, **kwargs):
        raise RuntimeError("binary_cross_entropy is unsafe to autocast")

    monkeypatch.setattr(F, "binary_cross_entropy", refused)
    assert soft_label_loss(student, teacher, temperature=2.0).item() == pytest.approx(expected.item(), rel=1e-5)


def test_student_adapter_starts_as_identity_and_learns_to_correct_a_stale_teacher():
    torch.manual_seed(0)
    adapter = StudentAdapter(num_tasks=1, num_surfaces=2)
    surface = torch.randint(0, 2, (4096,))
    teacher = torch.randn(4096, 1) * 2
    assert torch.equal(adapter(teacher, surface), teacher)  # starts as the identity
    # the world moved since the teacher was trained: true logits are shifted and scaled per surface
    truth = torch.where(surface[:, None] == 0, 0.5 * teacher - 1.0, teacher + 1.0)
    labels = torch.bernoulli(torch.sigmoid(truth))
    before = adapter.fit_loss(teacher, surface, labels).item()
    optimizer = torch.optim.Adam(adapter.parameters(), lr=0.05)
    for _ in range(300):
        optimizer.zero_grad()
        adapter.fit_loss(teacher, surface, labels).backward()
        optimizer.step()
    assert adapter.fit_loss(teacher, surface, labels).item() < before - 0.05
    corrected = adapter(teacher, surface).detach()
    assert (corrected - truth).abs().mean() < 0.5 * (teacher - truth).abs().mean()


def test_distilled_student_adds_the_distillation_terms_only_with_a_teacher():
    torch.manual_seed(0)
    student = BaselineRanker(SPEC, BaselineConfig(dim=8, num_heads=2, hidden=(16,)))
    model = DistilledStudent(student, student.representation_dim, len(SPEC.tasks), SPEC.num_surfaces, weight=2.0)
    batch = random_batch(16)
    plain = model(batch)
    assert plain.distillation_loss is None and plain.auxiliary_logits.shape == (16, 2)
    assert torch.equal(plain.logits, student(batch).logits)  # serving logits are the student's own
    teacher_logits = torch.randn(16, 2)
    taught = model(batch, teacher_logits)
    expected = model.adapter.fit_loss(teacher_logits, batch.surface, batch.labels) + 2.0 * soft_label_loss(
        taught.auxiliary_logits, taught.corrected_teacher_logits.detach()
    )
    torch.testing.assert_close(taught.distillation_loss, expected)
    torch.testing.assert_close(taught.aux_loss, plain.aux_loss + expected)


def test_the_teacher_reaches_the_serving_head_only_through_the_shared_trunk():
    torch.manual_seed(1)
    student = BaselineRanker(SPEC, BaselineConfig(dim=8, num_heads=2, hidden=(16,)))
    model = DistilledStudent(student, student.representation_dim, len(SPEC.tasks), SPEC.num_surfaces, adapter=False)
    batch = random_batch(16)
    out = model(batch, torch.randn(16, 2))
    out.distillation_loss.backward()
    assert student.heads.proj.weight.grad is None  # the serving head never sees teacher supervision
    assert model.auxiliary_head.proj.weight.grad.abs().sum() > 0
    assert student.mlp[0].weight.grad.abs().sum() > 0  # the trunk learns from it


def test_distillation_moves_the_auxiliary_head_towards_the_teacher():
    torch.manual_seed(2)
    teacher = BaselineRanker(SPEC, BaselineConfig(dim=8, num_heads=2, hidden=(16,))).eval()
    student = BaselineRanker(SPEC, BaselineConfig(dim=8, num_heads=2, hidden=(8,)))
    model = DistilledStudent(student, student.representation_dim, len(SPEC.tasks), SPEC.num_surfaces, adapter=False)
    batches = [random_batch(32, seed=s) for s in range(4)]
    with torch.no_grad():
        targets = [teacher(b).logits * 3 for b in batches]
    gap = lambda: sum(soft_label_loss(model(b).auxiliary_logits, t).item() for b, t in zip(batches, targets))
    before = gap()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    for _ in range(60):
        for b, t in zip(batches, targets):
            out = model(b, t)
            loss = multitask_loss(out.logits, b.labels, torch.ones(2)) + out.aux_loss
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    assert gap() < 0.5 * before


def test_listwise_loss_is_zero_at_the_teachers_distribution_and_ignores_a_shift_per_query():
    from gem_transfer import listwise_soft_label_loss

    teacher = torch.randn(16, 5)
    assert listwise_soft_label_loss(teacher.clone(), teacher).item() == pytest.approx(0.0, abs=1e-6)
    assert listwise_soft_label_loss(teacher + torch.randn(16, 1), teacher).item() == pytest.approx(0.0, abs=1e-5)
    assert listwise_soft_label_loss(teacher.flip(1), teacher).item() > 0.01
    with pytest.raises(ValueError, match="same shape"):
        listwise_soft_label_loss(teacher[:, :3], teacher)


def test_listwise_adapter_learns_the_sharpness_a_stale_teacher_lacks():
    from gem_transfer import ListwiseAdapter

    torch.manual_seed(0)
    adapter = ListwiseAdapter()
    teacher = torch.randn(4096, 8)
    assert torch.equal(adapter(teacher), teacher)
    # the true next item follows softmax(3 x teacher): the teacher is right about the order, too flat about it
    positive = torch.multinomial(torch.softmax(3 * teacher, 1), 1).squeeze(1)
    columns = torch.arange(8).expand(4096, -1)
    order = torch.where(columns == 0, positive[:, None], torch.where(columns <= positive[:, None], columns - 1, columns))
    teacher = teacher.gather(1, order)  # column 0 holds the item that came next, as in retrieval batches
    optimizer = torch.optim.Adam(adapter.parameters(), lr=0.05)
    for _ in range(300):
        optimizer.zero_grad()
        adapter.fit_loss(teacher).backward()
        optimizer.step()
    assert adapter.log_scale.exp().item() == pytest.approx(3.0, rel=0.15)
