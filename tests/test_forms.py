"""Block forms and block stacks on toy models: every declared form, blocks returning `None`, several block lists as one
stack, and the checks that refuse a wrong form at the first call (docs/architecture.md §2)."""

import pytest
import torch
from torch import nn
from toymodels import FormTransformer, TwoListTransformer, timesteps

import dicache
from dicache import BlockFormError, CacheConfig, ConfigError, UnsupportedModelError
from dicache.adapters import FORMS, stack_spec
from dicache.blocks.forms import fitting_forms
from dicache.engine.install import observe_blocks
from dicache.engine.policies import middle_segments

pytestmark = pytest.mark.usefixtures("one_torch_thread")

CACHE_ALL = dict(max_warmup_steps=2, residual_diff_threshold=1e9, max_continuous_cached_steps=-1)


def cfg(**kw):
    return CacheConfig.from_env({}, **kw)


def count_block_calls(blocks):
    """How many times each block's forward ran (forward pre-hooks: they see real runs only)."""
    counts = [0] * len(blocks)
    for i, block in enumerate(blocks):
        block.register_forward_pre_hook(lambda *a, i=i: counts.__setitem__(i, counts[i] + 1))
    return counts


def sample(model, steps=6, text_len=4, image_len=4, **kw):
    torch.manual_seed(1)
    h, e = torch.randn(1, image_len, 8), torch.randn(1, text_len, 8)
    with torch.no_grad():
        return [model(h, e, torch.tensor([t]), **kw) for t in timesteps(steps)]


def form_model(label, none_last=False):
    form = FORMS[label]
    torch.manual_seed(0)
    return FormTransformer(form.inputs, form.outputs, num_blocks=5, none_last=none_last).eval()


@pytest.mark.parametrize("none_last", [False, True], ids=["tensors", "last-e-None"])
@pytest.mark.parametrize("label", list(FORMS))
def test_every_declared_form_caches_and_caching_nothing_is_bitwise(label, none_last):
    if none_last and "e" not in FORMS[label].outputs:
        pytest.skip("only forms returning e can return None for it")
    model = form_model(label, none_last)
    plain = sample(model)
    dicache.enable(model, cfg(policy="never"), form=label)
    assert all(torch.equal(a, b) for a, b in zip(plain, sample(model)))
    counts = count_block_calls(model.blocks)
    dicache.enable(model, cfg(**CACHE_ALL), form=label)
    cached = sample(model)
    assert dicache.stats(model).branches["cond"].cached_steps == [2, 3, 4, 5]
    assert counts == [6, 2, 2, 2, 2]  # steps 0 and 1 compute; the cached steps 2-5 run block 0 only
    assert not torch.equal(cached[3], plain[3])
    dicache.disable(model)
    assert all(torch.equal(a, b) for a, b in zip(plain, sample(model)))


@pytest.mark.parametrize(
    ("first", "second"), [("(h, e) -> (h, e)", "(h, e) -> (e, h)"), ("h -> (h, e)", "h -> (e, h)")]
)
def test_the_output_order_only_changes_how_streams_are_read(first, second):
    """Two models with the same weights whose blocks return the streams in opposite orders cache identically."""
    outputs = []
    for label in (first, second):
        model = form_model(label)
        dicache.enable(model, cfg(**CACHE_ALL), form=label)
        outputs.append(sample(model))
    assert all(torch.equal(a, b) for a, b in zip(*outputs))


@pytest.mark.parametrize(
    ("actual", "given"),
    [
        ("(h, e) -> (e, h)", "(h, e) -> (h, e)"),  # the MMDiT swap, with both streams equally long
        ("(h, e) -> (h, e)", "(h, e) -> (e, h)"),
        ("h -> h", "(h, e) -> (h, e)"),
        ("(h, e) -> (h, e)", "h -> h"),
        ("h -> (e, h)", "h -> (h, e)"),
    ],
)
def test_a_wrong_form_is_refused_at_the_first_call_naming_the_form_that_fits(actual, given):
    model = form_model(actual)
    dicache.enable(model, cfg(), form=given)
    with pytest.raises(BlockFormError) as error:
        sample(model, steps=1)
    message = str(error.value)
    assert "FormTransformer.blocks[" in message and repr(given) in message and f"form={actual!r}" in message
    dicache.enable(model, cfg(), form=actual)  # the suggested form works
    sample(model, steps=2)


def test_fitting_forms_ranks_the_forms_that_read_more_streams_first():
    h, e = torch.randn(1, 4, 8), torch.randn(1, 4, 8)
    out = (e + 1, h + 1)
    names = {"h": "hidden_states", "e": "encoder_hidden_states"}
    fits = fitting_forms(names, (h, e), {}, out, {}, ((out[1], out[0]), {}))
    assert fits[0] == "(h, e) -> (e, h)" and "(h, e) -> (h, e)" not in fits


def test_form_values_are_checked_at_enable():
    model = form_model("h -> h")
    with pytest.raises(BlockFormError, match="'h => h' is not a block form; allowed: .*'h -> h'"):
        dicache.enable(model, form="h => h")
    two = TwoListTransformer()
    with pytest.raises(BlockFormError, match="lists 3 forms, and the model has 1 block lists"):
        dicache.enable(two, form=["h -> h"] * 3)
    with pytest.raises(BlockFormError, match="names 'single_blocks', which is not a non-empty nn.ModuleList"):
        dicache.enable(two, form={"transformer_blocks": "(h, e) -> (e, h)", "single_blocks": "h -> h"})
    assert not dicache.is_enabled(model) and not dicache.is_enabled(two)


# ---------------------------------------------------------------------- several block lists
def two_list_model():
    torch.manual_seed(0)
    return TwoListTransformer(num_dual=2, num_single=3).eval()


TWO_LISTS = {"transformer_blocks": "(h, e) -> (e, h)", "single_transformer_blocks": "h -> h"}


def test_two_lists_are_one_stack_and_a_cached_step_runs_no_middle_block_in_either_list():
    model = two_list_model()
    extra = [torch.full((1, 4, 8), 0.1), torch.full((1, 4, 8), -0.2)]
    plain = sample(model, extra=extra)
    dicache.enable(model, cfg(policy="never"), form=TWO_LISTS)
    assert all(torch.equal(a, b) for a, b in zip(plain, sample(model, extra=extra)))
    assert dicache.session_of(model).num_blocks == 5 and dicache.session_of(model).boundaries == (2,)
    dual, single = count_block_calls(model.transformer_blocks), count_block_calls(model.single_transformer_blocks)
    dicache.enable(model, cfg(**CACHE_ALL), form=TWO_LISTS)
    sample(model, extra=extra)
    assert dicache.stats(model).branches["cond"].cached_steps == [2, 3, 4, 5]
    assert dual == [6, 2] and single == [2, 2, 2]  # steps 0 and 1 compute; the cached steps 2-5 run block 0 only


def test_two_lists_cached_step_equals_the_hand_computed_estimate():
    """Oracle for Fn=1, Bn=0: a cached step runs block 0, answers the rest of the dual list with its input plus the
    dual part's residual of the last computed step (both streams), lets the model add its per-block residual and
    join the streams, then answers the single list with its input plus the single part's residual."""
    model = two_list_model()
    extra = [torch.full((1, 4, 8), 0.1), torch.full((1, 4, 8), -0.2)]
    settings = cfg(max_warmup_steps=1, residual_diff_threshold=1e9, max_continuous_cached_steps=-1)
    dicache.enable(model, settings, form=TWO_LISTS)
    out = sample(model, steps=2, extra=extra)
    torch.manual_seed(1)
    h, e = torch.randn(1, 4, 8), torch.randn(1, 4, 8)
    dual, single = model.transformer_blocks, model.single_transformer_blocks
    with torch.no_grad():

        def front(t):
            temb = torch.tensor([t]).reshape(-1, 1, 1)
            e1, h1 = dual[0](h, e, temb=temb)
            return temb, e1, h1 + extra[0]

        temb, e1, h1 = front(timesteps(2)[0])  # step 0, computed: the residuals
        e2, h2 = dual[1](h1, e1, temb=temb)
        r_dual = (e2 - e1, h2 - h1)
        joint = torch.cat([e2, h2 + extra[1]], dim=1)
        j = joint
        for block in single:
            j = block(j, temb=temb)
        r_single = j - joint
        temb, e1, h1 = front(timesteps(2)[1])  # step 1, cached
        e2, h2 = e1 + r_dual[0], h1 + r_dual[1]
        joint = torch.cat([e2, h2 + extra[1]], dim=1)
        expected = (joint + r_single)[:, 4:]
    assert dicache.stats(model).branches["cond"].cached_steps == [1]
    torch.testing.assert_close(out[1], expected, rtol=0, atol=1e-6)


def test_the_middle_is_cut_where_a_list_begins():
    assert [(s.start, s.stop) for s in middle_segments(5, 1, 0, None, boundaries=(2,))] == [(1, 2), (2, 5)]
    assert [(s.start, s.stop, s.cached) for s in middle_segments(6, 1, 1, [3], boundaries=(3,))] == [
        (1, 3, True),
        (3, 4, False),
        (4, 5, True),
    ]


def test_block_plans_index_the_whole_stack():
    model = two_list_model()

    class Recorder:
        def __init__(self):
            self.plans, self.ran = [], []

        def begin_call(self, info):
            self.ran.append([])

        def plan(self, plan):
            self.plans.append(plan)

        def before_block(self, index):
            self.ran[-1].append(index)

        def after_block(self, index):
            pass

        def end_call(self):
            pass

    rec = Recorder()
    stop = observe_blocks(stack_spec(model, TWO_LISTS), rec)
    mask = {"scm_compute_bins": [1, 1], "scm_cache_bins": [2], "scm_policy": "static", "max_warmup_steps": 0}
    dicache.enable(model, cfg(Fn_compute_blocks=1, Bn_compute_blocks=1, **mask), form=TWO_LISTS)
    with dicache.request(model, num_inference_steps=4):
        sample(model, steps=4)
    dicache.disable(model)
    stop()
    full, cached = [0, 1, 2, 3, 4], [0, 4]  # block 4 is the last single block: Bn over the whole stack
    assert rec.ran == [full, cached, cached, full]
    assert [list(p.blocks) for p in rec.plans] == rec.ran
    assert rec.plans[0].upcoming[:2] == (0, 4)


# ---------------------------------------------------------------------- loops the cache cannot follow
class IndexingTransformer(nn.Module):
    """Calls its blocks by index instead of iterating the list."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(8, 8) for _ in range(3)])

    def forward(self, hidden_states, timestep):
        for i in range(len(self.blocks)):
            hidden_states = self.blocks[i](hidden_states)
        return hidden_states


class TwiceTransformer(IndexingTransformer):
    def forward(self, hidden_states, timestep):
        for _ in range(2):
            for block in self.blocks:
                hidden_states = block(hidden_states)
        return hidden_states


@pytest.mark.parametrize(
    ("cls", "match"),
    [(IndexingTransformer, "ran none of its blocks through blocks"), (TwiceTransformer, "out of stack order")],
)
def test_a_loop_the_cache_cannot_follow_is_refused_at_the_first_call(cls, match):
    model = cls()
    dicache.enable(model)
    with pytest.raises(BlockFormError, match=match), torch.no_grad():
        model(torch.randn(1, 2, 8), torch.tensor([1.0]))


def test_separate_lists_cache_each_list_on_its_own():
    """`lists="separate"`: each list its own Fn block, decision and state (cache-dit's layout for some families)."""
    model = two_list_model()
    plain = sample(model)
    dicache.enable(model, cfg(policy="never"), form=TWO_LISTS, lists="separate")
    assert all(torch.equal(a, b) for a, b in zip(plain, sample(model)))
    dual, single = count_block_calls(model.transformer_blocks), count_block_calls(model.single_transformer_blocks)
    dicache.enable(model, cfg(**CACHE_ALL), form=TWO_LISTS, lists="separate")
    separate = sample(model)
    assert dicache.stats(model).num_blocks == 2  # the first list's cache
    assert dual == [6, 2] and single == [6, 2, 2]  # each list runs its own first block on cached steps
    dicache.enable(model, cfg(**CACHE_ALL), form=TWO_LISTS)
    assert not torch.equal(sample(model)[3], separate[3])  # joined: one decision, the single list is skipped too
    with pytest.raises(UnsupportedModelError, match="already hooked with the block lists grouped as"):
        observe_blocks(stack_spec(model, {"transformer_blocks": "(h, e) -> (e, h)"}), object())
    with pytest.raises(ConfigError, match="lists='split' is not a block-list layout; allowed: joined, separate"):
        dicache.enable(model, form=TWO_LISTS, lists="split")
    dicache.disable(model)
    assert all(torch.equal(a, b) for a, b in zip(plain, sample(model)))


def test_layerwise_offload_streams_blocks_of_both_lists():
    """The offloader indexes the stack over both lists: streamed blocks of either list load when their call runs
    them, and the output stays bitwise the resident one (CPU copies)."""
    from dicache.offload.layerwise import LayerwiseOffloader

    model = two_list_model()
    plain = sample(model)
    spec = stack_spec(model, TWO_LISTS)
    offloader = LayerwiseOffloader(model, resident=[0, 4], num_slots=1, device="cpu", spec=spec)
    dicache.enable(model, cfg(policy="never"), form=TWO_LISTS)
    assert all(torch.equal(a, b) for a, b in zip(plain, sample(model)))
    assert [call.ran for call in list(offloader.calls)[:1]] == [[0, 1, 2, 3, 4]]
    assert sorted(set(offloader.calls[0].copied)) == [1, 2, 3]  # the streamed blocks of both lists
    dicache.disable(model)
    offloader.close()
