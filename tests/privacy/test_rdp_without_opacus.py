"""The validation's reachable-epsilon bound is Opacus' RDP number, computed without Opacus' import.

`rdp_epsilon` loads Opacus' RDP analysis module by itself (Opacus' package imports torch, which
the workflow's parse must not); it must give exactly what the Opacus accountant gives.
"""

import subprocess
import sys
import warnings

import pytest
from opacus.accountants import RDPAccountant

from dpadapter.privacy.accounting import RDP_ORDERS, Segment, epsilon_from_history, rdp_epsilon


def test_the_orders_are_opacus_defaults():
    assert RDP_ORDERS == RDPAccountant.DEFAULT_ALPHAS


@pytest.mark.parametrize(
    "history",
    [
        [Segment(0.3, 0.1, 60)],
        [Segment(0.3, 0.004, 1000)],
        [Segment(1.1, 0.02, 500), Segment(0.8, 0.05, 40)],
        [Segment(5.0, 1.0, 3)],
        [Segment(1.0, 0.1, 0)],
        [Segment(0.0, 0.1, 10)],
    ],
)
@pytest.mark.parametrize("delta", [1e-5, 1e-3])
def test_rdp_epsilon_equals_the_opacus_accountant_bit_for_bit(history, delta):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        assert rdp_epsilon(history, delta) == epsilon_from_history(history, delta, "rdp")


@pytest.mark.process
def test_a_fresh_process_computes_it_without_importing_opacus_or_torch():
    code = (
        "import sys, warnings; warnings.simplefilter('ignore')\n"
        "from dpadapter.privacy import max_reachable_epsilon\n"
        "print(repr(max_reachable_epsilon(1e-5, 0.1, 60)), 'opacus' in sys.modules,"
        " 'torch' in sys.modules)\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    value, opacus_loaded, torch_loaded = r.stdout.split()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        want = epsilon_from_history([Segment(0.3, 0.1, 60)], 1e-5, "rdp")
    assert (float(value), opacus_loaded, torch_loaded) == (want, "False", "False")
