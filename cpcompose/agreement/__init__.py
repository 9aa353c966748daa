"""The cross-rank agreement: every rank checks, and agrees, before any data moves.

One home for the rule "every rank computes the exact result or raises the same clear
error before any collective": `Signature` builds the named integers ranks must share,
`agree_across_ranks` runs the blocking check (one tiny all-gather), and `agreed_call`
runs it only when a call is not the one every rank expects (`expected.py`), which is
what per-layer entry points such as `cp_attention` use.
"""

from cpcompose.agreement.agree import agree_across_ranks
from cpcompose.agreement.expected import AgreementCache, CallSpec, agreed_call, agreement_cache
from cpcompose.agreement.signature import Field, Signature, dtype_code, float_code, int_code, shape_fields

__all__ = [
    "AgreementCache", "CallSpec", "Field", "Signature", "agree_across_ranks", "agreed_call", "agreement_cache",
    "dtype_code", "float_code", "int_code", "shape_fields",
]
