"""Fuzz cases of chapter 19 (calibration and uncertainty): ``llmbook.lm.calibration``."""

from .cases import POS_INT, Float, add

CA = "llmbook.lm.calibration:"


def _classifier(m):
    return dict(probs=m.probs(m.s.B, m.s.V), labels=m.ids(m.s.B, high=m.s.V))


add(CA + "expected_calibration_error", _classifier, scalars=dict(n_bins=POS_INT))
add(CA + "maximum_calibration_error", _classifier, scalars=dict(n_bins=POS_INT))
add(CA + "brier_score", _classifier)
add(CA + "temperature_scale", lambda m: dict(logits=m.f(m.s.B, m.s.T, m.s.V), T=2.0),
    scalars=dict(T=Float(0, lo_open=True, inf_ok=True)))
add(CA + "selective_risk", lambda m: dict(loss=m.pos(m.s.B), g=m.pos(m.s.B) - 0.5))
add(CA + "conformal_prediction_set", lambda m: dict(probs=m.probs(m.s.B, m.s.V), q_hat=0.5),
    scalars=dict(q_hat=Float(inf_ok=True)))
