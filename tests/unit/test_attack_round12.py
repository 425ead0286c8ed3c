"""Attack pass, round 12: ``irisfed web --refused-retry`` (WebSettings.refused_retry_s).

Hostile values must stop the dashboard before it starts anything, with a message
naming the setting and its flag; what reaches the page and the Retry-After header is
a plain whole number."""

from __future__ import annotations

import re

import pytest

from irisfed.services.common.startup import service_parser
from irisfed.services.web import flags
from irisfed.services.web.settings import MAX_REFUSED_RETRY_S, WebSettings
from irisfed.shared.errors import ConfigError

NAMED = re.compile(r"^web setting refused_retry_s \(--refused-retry\) must be ")


@pytest.mark.parametrize("given", ["nan", "NaN", "inf", "-inf", "-1", "0", "-0", "1e308", "86401", "0.5",
                                   "0.0004", "1e-9"])
def test_a_hostile_flag_value_is_a_config_error_naming_the_setting(given):
    args = service_parser("web").parse_args([f"--refused-retry={given}"])
    with pytest.raises(ConfigError) as refused:
        flags.settings(args, None)
    assert NAMED.match(refused.value.message), refused.value.message
    assert "got " in refused.value.message


@pytest.mark.parametrize("given", ["30s", "", "0x10", "1_0_", "true", "None", "\u0661e308x"])
def test_what_is_no_number_is_refused_by_the_parser(given, capsys):
    with pytest.raises(SystemExit) as refused:
        service_parser("web").parse_args([f"--refused-retry={given}"])
    assert refused.value.code == 2
    assert "--refused-retry" in capsys.readouterr().err


@pytest.mark.parametrize("value", [float("nan"), float("inf"), -1, 0, 0.5, MAX_REFUSED_RETRY_S + 0.001, 10**10,
                                   True, False, "30", None, [30], 1j])
def test_hostile_values_given_in_code_are_refused(value):
    with pytest.raises(ConfigError) as refused:
        WebSettings(refused_retry_s=value)
    assert NAMED.match(refused.value.message), refused.value.message


@pytest.mark.parametrize("value", [1, 1.0, 2.5, 30, MAX_REFUSED_RETRY_S])
def test_the_bounds_themselves_are_accepted(value):
    assert WebSettings(refused_retry_s=value).refused_retry_s == value
