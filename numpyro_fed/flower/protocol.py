"""Transport-independent protocol of the federated kernels: client worker and server
(compatibility location: the roles live in :mod:`~numpyro_fed.flower.spec`,
:mod:`~numpyro_fed.flower.client`, :mod:`~numpyro_fed.flower.server`,
:mod:`~numpyro_fed.flower.transport` and :mod:`~numpyro_fed.flower.catchup`).

:class:`ClientWorker` is what a client runs: it holds only its own data and its own state
(QLSD memory term :math:`\\eta_i`, QLSD++ control point :math:`\\zeta` and
:math:`\\nabla U_i(\\zeta)`, QLSD*'s :math:`\\theta^\\star` and :math:`\\nabla U_i(\\theta^\\star)`,
the ELF error-feedback estimator :math:`g_i`, P-/B-ELF's shadow model :math:`w`) and answers
the server's instructions with compressed messages. :class:`ServerCoordinator` runs the
kernel's server step: it draws the Langevin noise, asks the clients, receives only compressed
messages, aggregates them and stores the draws. Neither computes an algorithm step of its
own: the client calls the client half of :mod:`numpyro_fed.algorithms.qlsd` /
:mod:`numpyro_fed.algorithms.elf` (the variant's
:class:`~numpyro_fed.algorithms.estimators.GradientEstimator` on its
:class:`~numpyro_fed.algorithms.oracles.ClientProblem`, ``client_message``, ``client_commit``,
``shadow_update``), the server their server half (``server_aggregate`` on the ``(b, d)``
decoded messages with zero rows for absent clients, ``server_move``, ``downlink_message``)
and :mod:`numpyro_fed.algorithms.theta_star` for QLSD*'s search -- the functions the
in-process kernels call -- with the kernels' random keys (the step key split
``(rng_key, k_noise, k_alg) = split(rng_key, 3)``, client ``i`` drawing its minibatch from its
own words of the batch key (:func:`~numpyro_fed.potential.client_bits`) and compressing with
``split(k, b)[i]``). What this module adds is transport: instructions, acknowledgements,
catch-ups, faults and bit accounting on the wire. So for a fixed seed and no faults the
deployment reproduces ``QLSD``/``ELF`` run in process up to float32 summation order (a
client sums over its :math:`N_i` rows, the kernel over padded rows).

**Consistency under faults.** A client's state update that depends on the server applying
its message (QLSD's :math:`\\eta_i \\mathrel{+}= \\alpha g_i`, D-/B-ELF's
:math:`g_i \\mathrel{+}= c_i`) is kept *pending* and committed only when the server's next
instruction acknowledges that round (``ack``). A message that was lost, late or rejected is
never acknowledged, so client and server state never diverge
(:math:`\\eta = \\sum_i \\eta_i`, :math:`g = \\sum_i g_i`; P-ELF's server keeps the last dense
:math:`g_i` of every client). Reweighting of the received messages:
:mod:`numpyro_fed.algorithms.participation`.

**P-/B-ELF: the compressed model broadcast and its catch-up** (ELF Alg. 2-3, EF21-P). The
server owns the shadow model :math:`w_k = w_{k-1} + \\mathcal{Q}^P(x_{k+1} - w_{k-1})` and
sends the *serialised compressed update* of round ``k``; every client keeps its own copy of
:math:`w` and the round ``w_round`` it corresponds to. A client that missed rounds (not
sampled, message dropped, reply lost) is brought up to date the next time it is asked, with
the cheaper of two exact options, chosen per client and counted in its downlink bits:

* *replay*: the compressed updates of the missed rounds ``a+1..k`` (``a`` = the last round the
  server knows the client holds), which the client adds in order with the same float32
  additions as the server -- bitwise the server's :math:`w_k`; a client that already holds a
  later round than ``a`` (its reply was lost) skips the updates it has;
* *dense*: :math:`w_k` itself (``32 d`` bits), when the replay would cost at least as much.

So a rejoining client never pays more than one dense model, the server keeps only the updates
whose replay is still cheaper than a dense model (a bounded history), and no approximation is
made: client and server :math:`w` are equal bit for bit (checked by the tests).

**QLSD*** (Alg. 2 with :math:`\\theta^\\star`). :math:`\\theta^\\star` is either given
(constrained site values, as in process) or found by the federated Barzilai--Borwein (or Adam)
descent of :func:`~numpyro_fed.kernels.qlsd.find_theta_star`, one round per gradient
evaluation (dense :math:`\\theta` down, dense :math:`\\nabla U_i(\\theta)` up, every client
required); then one counted round broadcasts :math:`\\theta^\\star` and collects
:math:`\\nabla U_i(\\theta^\\star)`, the server keeps :math:`g^\\star = \\sum_i
\\nabla U_i(\\theta^\\star)` and the clients send
:math:`\\mathcal{C}(H_i(\\theta) - H_i(\\theta^\\star))`.

Supported kernels: QLSD#, QLSD* and QLSD++ (any unbiased compressor with a wire format,
memory, minibatches, participation), D-ELF, P-ELF and B-ELF (any contractive compressor with a
wire format, minibatches, participation).
"""

from __future__ import annotations

from numpyro_fed.flower.client import ClientWorker, nonfinite_reply, probes
from numpyro_fed.flower.server import RoundLog, ServerCoordinator
from numpyro_fed.flower.spec import (
    FlowerSpec,
    divergence_message,
    kernel_display_name,
    load_model,
    wire_name,
)
from numpyro_fed.flower.transport import Reply, Transport

__all__ = [
    "FlowerSpec",
    "ClientWorker",
    "ServerCoordinator",
    "Transport",
    "Reply",
    "RoundLog",
    "load_model",
    "probes",
    "nonfinite_reply",
    "kernel_display_name",
    "divergence_message",
    "wire_name",
]
