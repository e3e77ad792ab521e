"""``--variant NAME:key=value,...``: one more ``pallas_attn/NAME`` row per workload, the public function called with
extra arguments.

    --variant bn64:config.block_n=64                    # a field of the op's default config
    --variant split4:num_splits=4                       # a keyword argument of the public function
    --variant mosaic-pc4:backend=mosaic,config.p_chunks=4
    --variant softcap:softcap=50                        # a model-family feature turned on
    --variant sinks:sinks=1                             # f32[num_q_heads] sinks (ALiBi slopes: alibi=1)
    --variant bwd64:backward_config.block_n=64          # the backward's tiles (training steps only)

A ``key`` is a keyword argument of the workload's public function (``varlen_attention``, ``paged_decode_attention``,
``paged_attention``, ``sparse_mla_attention``, ``mla_attention``); ``ARG.FIELD`` sets a field of the config argument
``ARG`` (``config``, ``chunk_config`` of ``paged_attention``, or ``backward_config`` of ``varlen_attention``'s
gradient): ``dataclasses.replace(<the op's default config>, FIELD=value)``, the default being the one the op itself
would use for the workload's shapes and backend. Values parse as int, float, ``true``/``false``/``none``, ``a/b`` (a
tuple of ints), else a string. A variant runs on the workloads whose function takes all its keyword arguments (one
with ``backward_config`` on the training steps only: a forward never reads it); ``config.`` fields the config lacks
give an error row.

A model-family key (``window_size=127/0``, ``softcap=50``, ``sinks=1``, ``alibi=1``) changes the workload the row
runs (:class:`benchmarks.workloads.Spec`'s fields of the same names): the sinks and slopes are those
:func:`benchmarks.workloads.build_arrays` drew, the reference check uses the feature too, and the metrics count what
the feature leaves visible. Such a row's ``ratio_to_twin``, like any other variant's, is its metric over the
``pallas_attn`` row: the same call without it (both on the backend ``varlen_attention``'s default rule picks, which
takes the features on either prefill kernel).
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any

from benchmarks.impls import FUNCTION_BY_KIND, OURS, Impl, Options, Prepared, _prepare_ours, takes_for_kind
from benchmarks.workloads import FEATURE_KWARGS, PACKED_KINDS, Batch, Spec, with_spec

CONFIG_ARGS = ("config", "chunk_config", "backward_config")
FEATURE_FIELDS = {field: kwarg for kwarg, field in FEATURE_KWARGS.items()}  # --variant key -> keyword argument


@dataclasses.dataclass(frozen=True)
class Variant:
    name: str  # the row is pallas_attn/<name>
    kwargs: tuple[tuple[str, Any], ...]  # plain keyword arguments
    fields: tuple[tuple[str, str, Any], ...]  # (config argument, field, value)
    text: str  # as given on the command line, for the row's note
    features: tuple[tuple[str, Any], ...] = ()  # (Spec field, value): model-family features turned on

    @property
    def impl_name(self) -> str:
        return f"{OURS}/{self.name}"

    def arg_names(self) -> set[str]:
        return ({k for k, _ in self.kwargs} | {arg for arg, _, _ in self.fields}
                | {FEATURE_FIELDS[f] for f, _ in self.features})

    def spec_for(self, spec: Spec) -> Spec:
        return dataclasses.replace(spec, **dict(self.features)) if self.features else spec

    def twin_impl(self, spec: Spec) -> str:
        return OURS


def parse_value(text: str) -> Any:
    low = text.strip().lower()
    if low in ("true", "false"):
        return low == "true"
    if low == "none":
        return None
    if "/" in text:
        return tuple(int(x) for x in text.split("/"))
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    return text


def parse(text: str) -> Variant:
    """``NAME:key=value,...`` → :class:`Variant` (raises ``ValueError`` with the expected form)."""
    name, sep, body = text.partition(":")
    name = name.strip()
    if not sep or not name or "/" in name or not body.strip():
        raise ValueError(f"--variant {text!r}: expected NAME:key=value[,key=value...] (NAME without '/')")
    kwargs, fields, features = [], [], []
    for item in body.split(","):
        key, eq, value = item.partition("=")
        key = key.strip()
        if not eq or not key:
            raise ValueError(f"--variant {text!r}: {item!r} is not key=value")
        if key in FEATURE_FIELDS:
            features.append((key, _feature_value(text, key, parse_value(value))))
        elif key in FEATURE_KWARGS:
            raise ValueError(f"--variant {text!r}: turn {key} on with {FEATURE_KWARGS[key]}=1 (the harness draws "
                             "the array)")
        elif "." in key:
            arg, field = key.split(".", 1)
            if arg not in CONFIG_ARGS:
                raise ValueError(f"--variant {text!r}: {arg!r} is not a config argument ({', '.join(CONFIG_ARGS)})")
            fields.append((arg, field, parse_value(value)))
        else:
            if key in CONFIG_ARGS:
                raise ValueError(f"--variant {text!r}: set config fields one by one ({key}.FIELD=value)")
            kwargs.append((key, parse_value(value)))
    return Variant(name, tuple(kwargs), tuple(fields), body.strip(), tuple(features))


def _feature_value(text: str, key: str, value: Any) -> Any:
    """A model-family key's value as the Spec field holds it: a window pair, a float soft-cap, a flag."""
    if key == "window_size":
        if not (isinstance(value, tuple) and len(value) == 2):
            raise ValueError(f"--variant {text!r}: window_size=LEFT/RIGHT (-1: unbounded), e.g. 127/0")
        return value
    if key == "softcap":
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"--variant {text!r}: softcap takes a number (0: off)")
        return float(value)
    if value not in (0, 1, True, False):
        raise ValueError(f"--variant {text!r}: {key} takes 1 or 0 (true / false)")
    return bool(value)


def _public_function(kind: str):
    import pallas_attn
    return getattr(pallas_attn, FUNCTION_BY_KIND[kind])


def accepts(spec: Spec, variant: Variant) -> bool:
    """The workload's public function takes every keyword argument the variant sets (``backward_config``: a
    training step's only)."""
    params = inspect.signature(_public_function(spec.kind)).parameters
    if "backward_config" in variant.arg_names() and spec.kind != "prefill-bwd":
        return False
    return variant.arg_names() <= set(params)


def default_config(spec: Spec, arg: str, backend: str | None):
    """The config the op would use on this workload when ``arg`` is not given (``backend`` as the variant sets it;
    a prefill or sparse config without a backend means the Triton kernel, as the ops read it)."""
    import pallas_attn
    from pallas_attn.core import config as config_lib
    d, item = spec.head_dim, spec.jnp_dtype.itemsize
    if arg == "chunk_config":
        return config_lib.default_chunk_config(d, spec.block_size, item)
    if arg == "backward_config":
        return config_lib.default_backward_config(d)
    if spec.kind in PACKED_KINDS:
        if backend == "mosaic":
            cls = getattr(pallas_attn, "MosaicPrefillConfig", None)
            if cls is None:
                raise ValueError("this pallas_attn has no MosaicPrefillConfig: the Mosaic prefill takes no config")
            return cls()
        return config_lib.default_prefill_config(d, item)
    if spec.kind in ("decode", "ragged"):
        return config_lib.default_decode_config(d, spec.block_size, item)
    if spec.kind == "sparse":
        if backend == "mosaic":
            raise ValueError("the Mosaic sparse MLA kernel takes no config")
        return config_lib.default_sparse_config(spec.num_q_heads)
    if spec.kind == "mla":  # a decode's config is that of one token per request, as mla_attention picks it
        return config_lib.default_mla_config(spec.num_q_heads, max(g.q_len or 1 for g in spec.groups))
    raise ValueError(f"unknown workload kind {spec.kind!r}")


def resolve(spec: Spec, variant: Variant) -> dict[str, Any]:
    """The keyword arguments of the call: the plain ones, and each config argument with its fields replaced."""
    kw = dict(variant.kwargs)
    for arg in dict.fromkeys(a for a, _, _ in variant.fields):
        base = default_config(spec, arg, kw.get("backend"))
        known = {f.name for f in dataclasses.fields(base)}
        changes = {f: v for a, f, v in variant.fields if a == arg}
        unknown = sorted(set(changes) - known)
        if unknown:
            raise ValueError(f"{type(base).__name__} has no field(s) {unknown}; fields: {sorted(known)}")
        kw[arg] = dataclasses.replace(base, **changes)
    return kw


def make_impl(variant: Variant) -> Impl:
    def prepare(batches: list[Batch], options: Options) -> Prepared:
        batches = [with_spec(b, variant.spec_for(b.spec)) for b in batches]  # the harness may have done it already
        kw = resolve(batches[0].spec, variant)
        prepared = _prepare_ours(batches, options, **kw)
        prepared.note = "; ".join(x for x in (variant.text, prepared.note) if x)
        return prepared

    return Impl(variant.impl_name, lambda s: accepts(s, variant), prepare, anchor=False, features=takes_for_kind,
                spec_for=variant.spec_for, twin_impl=variant.twin_impl)


def make_impls(texts: list[str] | None, taken: set[str]) -> list[Impl]:
    """The ``--variant`` rows; a name already in use (``pallas_attn/triton``, another variant) raises."""
    out = []
    for text in texts or []:
        variant = parse(text)
        if variant.impl_name in taken:
            raise ValueError(f"--variant {text!r}: {variant.impl_name} is already an implementation")
        taken.add(variant.impl_name)
        out.append(make_impl(variant))
    return out
