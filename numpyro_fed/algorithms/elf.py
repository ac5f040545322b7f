"""ELF's client and server halves as pure functions (Karagulyan & Richtárik 2023, Alg. 1-3).

One round of D-ELF (EF21 on the uplink), P-ELF (EF21-P on the downlink) or B-ELF (both), in the
order of Algorithm 3 (sum convention :math:`U = U_0 + \\sum_i U_i`, see
:mod:`numpyro_fed.kernels.elf`):

.. math::

    \\text{server}:&\\quad x_{k+1} = x_k - \\gamma[\\nabla U_0(x_k) + g_k] + \\sqrt{2\\gamma}Z_k,
    \\qquad w_{k+1} = w_k + \\mathcal{Q}^P(x_{k+1} - w_k) \\;(\\text{P, B; D: } w = x) \\\\
    \\text{client } i:&\\quad c_i = \\mathcal{Q}^D(H_i(w_{k+1}) - g^i_k),\\quad
    g^i_{k+1} = g^i_k + c_i \\;(\\text{D, B; P: } g^i_{k+1} = H_i(w_{k+1}) \\text{ dense}) \\\\
    \\text{server}:&\\quad g_{k+1} = g_k + \\textstyle\\sum_i c_i \\;(\\text{P: }
    \\textstyle\\sum_i g^i_{k+1})

With partial participation only the senders' corrections are applied (no reweighting: error
feedback absorbs the missing updates, and :math:`g = \\sum_i g^i` keeps holding).

As in :mod:`numpyro_fed.algorithms.qlsd`, the client functions serve one client or a stack of
clients, and the server half takes the decoded messages as a ``(b, d)`` array (zero rows for
absent clients), in process (:class:`~numpyro_fed.kernels.elf.ELF`) and deployed
(:mod:`numpyro_fed.flower`) alike.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import random

from numpyro_fed._validation import check_int, check_positive_float
from numpyro_fed.algorithms import estimators
from numpyro_fed.algorithms.federated import FederatedAlgorithm, RoundKeys, SetupRound
from numpyro_fed.algorithms.langevin import langevin_move
from numpyro_fed.algorithms.participation import check_participation
from numpyro_fed.algorithms.variants import canonical_variant, variant_info, variant_of_algorithm
from numpyro_fed.compressors import Compressor, get_compressor

__all__ = ["ELFServerState", "ELFClientState", "ELFAlgServerState", "algorithm",
           "check_contractive", "server_move", "downlink_message", "shadow_update",
           "client_message", "client_commit", "server_aggregate"]


class ELFServerState(NamedTuple):
    """What the ELF server keeps: **g** -- its estimator :math:`g_k` ``(d,)``; **w** -- the
    shadow model :math:`w_k` the clients hold (P-/B-ELF; :math:`x_k` for D-ELF)."""

    g: jax.Array
    w: jax.Array


def server_move(key: jax.Array, x: jax.Array, g: jax.Array, server_grad: jax.Array,
                step_size: float) -> jax.Array:
    """:math:`x_{k+1} = x_k - \\gamma[\\nabla U_0(x_k) + g_k] + \\sqrt{2\\gamma}Z_k`."""
    return langevin_move(key, x, server_grad + g, step_size)


def downlink_message(x_new: jax.Array, w: jax.Array) -> jax.Array:
    """The vector the server compresses for the EF21-P broadcast: :math:`x_{k+1} - w_k`."""
    return x_new - w


def shadow_update(w: jax.Array, decoded: jax.Array) -> jax.Array:
    """:math:`w + \\mathcal{Q}^P(\\cdot)`: the same float32 addition on the server and on every
    client (so that their shadow models are equal bit for bit)."""
    return w + decoded


def client_message(h: jax.Array, g_local: jax.Array, error_feedback: bool) -> jax.Array:
    """The vector client :math:`i` sends: :math:`H_i(w_{k+1}) - g^i_k` (D-, B-ELF, to be
    compressed) or :math:`H_i(w_{k+1})` (P-ELF, dense)."""
    return h - g_local if error_feedback else h


def client_commit(g_local: jax.Array, decoded: jax.Array, error_feedback: bool) -> jax.Array:
    """The client's estimator after the server applied its message:
    :math:`g^i + c_i` (EF21) or the dense gradient it sent (P-ELF)."""
    return g_local + decoded if error_feedback else decoded


def server_aggregate(g: jax.Array, decoded: jax.Array, error_feedback: bool,
                     table: jax.Array | None = None,
                     mask: jax.Array | None = None) -> tuple[jax.Array, jax.Array | None]:
    """The server's new estimator :math:`g_{k+1}`.

    :param g: :math:`g_k`.
    :param decoded: ``(b, d)`` decoded messages (zero rows for absent clients).
    :param error_feedback: D-/B-ELF (``True``: add the corrections) or P-ELF (``False``:
        dense gradients replace the clients' last ones).
    :param table: P-ELF: ``(b, d)`` the last dense gradient of every client (the server's
        copy of the :math:`g^i`); ignored otherwise.
    :param mask: ``(b,)`` booleans of the applied messages; ``None``: all.
    :return: ``(g_{k+1}, table)`` (P-ELF's updated table, else ``table`` unchanged).
    """
    if error_feedback:
        c = decoded if mask is None else jnp.where(mask[:, None], decoded, 0.0)
        return g + jnp.sum(c, axis=0), table
    if mask is None:
        return jnp.sum(decoded, axis=0), decoded
    new = jnp.where(mask[:, None], decoded, table)
    return g + jnp.sum(new - table, axis=0), new


# ============================================================================ the algorithm
class ELFClientState(NamedTuple):
    """What an ELF client keeps: **g** -- its estimator :math:`g^i_k` (``(d,)``, ``(b, d)``
    stacked): EF21's (D-, B-ELF) or the dense gradient it last sent (P-ELF)."""

    g: jax.Array


class ELFAlgServerState(NamedTuple):
    """What the ELF server keeps: **g** -- :math:`g_k = \\sum_i g^i_k`; **table** -- P-ELF:
    the ``(b, d)`` last dense gradients of the clients (``()`` for D-, B-ELF)."""

    g: jax.Array
    table: Any = ()


_W0_MODES = ("x0", "compressed")
#: ELF's setup round: the clients' dense gradients at their initial view :math:`w_0`.
_INIT = SetupRound("init", "start", "ELF initial round")


def check_contractive(compressor: Compressor | str | None, arg: str,
                      who: str = "error feedback") -> Compressor:
    """``compressor`` as a :class:`~numpyro_fed.compressors.Compressor`, checked contractive
    (ELF Def. 2.1: ``alpha`` defined).

    :raises ValueError: for an unbiased compressor that is not contractive (e.g. raw
        ``quantize`` or ``rand_k``), suggesting ``compressors.scaled(...)``.
    """
    comp = get_compressor(compressor)
    if comp.alpha is None:
        raise ValueError(
            f"`{arg}`={comp.name} is not a contractive compressor (ELF Def. 2.1): {who} needs "
            f"a contractive `{arg}`. Use compressors.top_k(k), or scale an unbiased "
            f"compressor by 1/(omega+1): compressors.scaled({comp.name})."
        )
    return comp


def algorithm(
    variant: str = "D",
    *,
    step_size: float,
    uplink: Compressor | str | None = None,
    downlink: Compressor | str | None = None,
    w0: str = "x0",
    batch_size: int | None = None,
    participation: float = 1.0,
    factory: str = "numpyro_fed.algorithms.elf:algorithm",
) -> FederatedAlgorithm:
    """D-, P- or B-ELF (Karagulyan & Richtárik 2023, Alg. 1-3) as a
    :class:`~numpyro_fed.algorithms.federated.FederatedAlgorithm`, validated here once.

    :param variant: ``"D"``, ``"P"``, ``"B"`` (or any spelling of the variant table).
    :param uplink: contractive :math:`\\mathcal{Q}^D` (D, B; ``None``: identity).
    :param downlink: contractive :math:`\\mathcal{Q}^P` (P, B; ``None``: identity).
    :param w0: ``"x0"`` (:math:`w_0 = x_0`) or ``"compressed"`` (:math:`w_0 =
        \\mathcal{Q}^P(x_0)`, eq. (3); P, B).
    :raises ValueError: for a compressor of a direction the variant does not compress, a
        compressor that is not contractive, or another ``w0``, naming the argument.
    """
    variant = canonical_variant("elf", variant)
    info = variant_info("elf", variant)
    step_size = check_positive_float("step_size", step_size)
    participation = check_participation(participation)
    batch_size = check_int("batch_size", batch_size, minimum=1, allow_none=True,
                           hint=" Use None for full-batch gradients.")
    if not info.compress_up and uplink is not None and not get_compressor(uplink).is_identity:
        raise ValueError(
            "P-ELF sends dense gradients on the uplink and takes no `uplink` compressor; "
            "use variant='B' (BELF) to compress both directions."
        )
    if not info.compress_down and downlink is not None and not get_compressor(
            downlink).is_identity:
        raise ValueError(
            "D-ELF broadcasts the dense model and takes no `downlink` compressor; "
            "use variant='B' (BELF) to compress both directions."
        )
    if w0 not in _W0_MODES:
        raise ValueError(f"`w0` must be one of {_W0_MODES}, got {w0!r}.")
    if w0 == "compressed" and not info.compress_down:
        raise ValueError(
            "`w0='compressed'` (w_0 = Q^P(x_0), ELF eq. (3)) needs a downlink compressor: "
            "use variant 'P' or 'B'."
        )
    up = check_contractive(uplink, "uplink", f"{info.display}'s error feedback")
    down = check_contractive(downlink, "downlink", f"{info.display}'s error feedback")
    ef = info.compress_up
    dense_table = not ef

    def round_keys(k_alg):
        k_batch, k_down, k_up = random.split(k_alg, 3)
        return RoundKeys(k_batch, k_up, k_down, k_alg)

    def init_client(oracle, view, setup):
        return ELFClientState(setup["init"].grads)

    def init_server(x, setup, srv):
        r = setup["init"]
        return ELFAlgServerState(r.total, r.grads if dense_table else ())

    def refresh(oracle, point, state):
        return state

    def client_step(oracle, keys, view, state, setup):
        h = estimators.plain(batch_size).estimate(oracle, keys.batch, view, ())
        return client_message(h, state.g, ef)

    def commit(state, decoded, mask=None):
        if ef:
            applied = decoded if mask is None else jnp.where(mask[:, None], decoded, 0.0)
            return ELFClientState(client_commit(state.g, applied, ef))
        return ELFClientState(decoded if mask is None
                              else jnp.where(mask[:, None], decoded, state.g))

    def server_broadcast(noise_key, x, server, srv, setup):
        return server_move(noise_key, x, server.g, srv.server_grad(x), step_size)

    def server_step(noise_key, x, point, server, decoded, mask, srv, setup):
        g, table = server_aggregate(server.g, decoded, ef, server.table, mask)
        return point, ELFAlgServerState(g, table if dense_table else ())

    options = {"variant": variant, "step_size": step_size, "batch_size": batch_size,
               "uplink": up.spec.text if up.spec is not None else None,
               "downlink": down.spec.text if down.spec is not None else None,
               "w0": w0, "participation": participation}
    description: dict[str, Any] = {"factory": factory, "options": options}
    for arg, comp in (("uplink", up), ("downlink", down)):
        if comp.spec is None:
            description["error"] = (f"`{arg}`={comp.name} has no `spec`: a custom compressor "
                                    "cannot be deployed.")
    return FederatedAlgorithm(
        name=info.display, description=description, step_size=step_size,
        batch_size=batch_size, participation=participation,
        uplink=up if info.compress_up else None, downlink=down if info.compress_down else None,
        compressed_start=w0 == "compressed", setup=(_INIT,), search=None, moves_first=True,
        refresh_every=None, round_keys=round_keys, init_client=init_client,
        init_server=init_server, refresh=refresh, client_step=client_step, commit=commit,
        server_broadcast=server_broadcast, server_step=server_step)


def from_fields(fields: Mapping[str, Any]) -> FederatedAlgorithm:
    """The ELF algorithm of a deployment's flat settings
    (:class:`~numpyro_fed.flower.spec.FlowerSpec` fields: ``algorithm`` ``"delf"`` /
    ``"pelf"`` / ``"belf"``, ``compressor`` (:math:`\\mathcal{Q}^D`; ``"identity"`` for
    P-ELF), ``downlink``, ``w0``, ``batch_size`` (0: exact), ``step_size``,
    ``participation``)."""
    info = variant_of_algorithm(fields["algorithm"], "")
    if fields.get("theta_star"):
        raise ValueError("`theta_star` is only used by QLSD* (algorithm='qlsd', variant='*').")
    up, down = fields.get("compressor", "identity"), fields.get("downlink", "identity")
    if not info.compress_up and not get_compressor(up).is_identity:
        raise ValueError(f"P-ELF sends dense gradients: `compressor` must be 'identity', got "
                         f"{up!r} (use algorithm='belf' to compress both ways).")
    if not info.compress_down and not get_compressor(down).is_identity:
        raise ValueError(f"`downlink`={down!r} is only used by P-ELF and B-ELF "
                         f"(algorithm={fields['algorithm']!r} broadcasts the dense model).")
    return algorithm(
        info.code, step_size=fields["step_size"], uplink=up if info.compress_up else None,
        downlink=down if info.compress_down else None, w0=fields.get("w0", "x0"),
        batch_size=fields.get("batch_size") or None,
        participation=fields.get("participation", 1.0))


def to_fields(options: Mapping[str, Any]) -> dict[str, Any]:
    """The deployment's flat settings of :func:`algorithm`'s ``options``: the inverse of
    :func:`from_fields`."""
    info = variant_info("elf", options["variant"])
    return {"algorithm": info.algorithm,
            "compressor": options["uplink"] if info.compress_up else "identity",
            "downlink": options["downlink"] if info.compress_down else "identity",
            "w0": options["w0"], "batch_size": options["batch_size"] or 0,
            "step_size": options["step_size"], "participation": options["participation"]}
