"""ops.input_fault: a fault recorded once (the first kept), and its words from a template."""
import numpy as np

from ops.input_fault import fault_message, record_fault_cpu


def test_the_first_fault_is_kept():
    bad = np.zeros(4, np.int64)
    record_fault_cpu(bad, 7, 2, 5)
    record_fault_cpu(bad, -1, 3, 5)
    assert bad.tolist() == [1, 7, 2, 5]


def test_the_message_fills_value_where_and_limit_and_says_when_deferred():
    message = fault_message("label {0} at row {1} is outside [0, {2})", "a recent CUDA batch")
    values = np.array([1, 7, 2, 5], np.int64)
    assert message(values, False) == "label 7 at row 2 is outside [0, 5)"
    assert message(values, True) == "label 7 at row 2 is outside [0, 5) (a recent CUDA batch)"
