"""The job's flags as one frozen record: every flag a typed field, in the parser's order
(``args.json`` writes them so), changed only by ``dataclasses.replace``."""

import dataclasses

import pytest

from jaxrec.jobs.dlrm_config import DlrmJobConfig
from jaxrec.jobs.dlrm_flags import parse_args, parse_config


def test_every_flag_is_a_field_in_the_parser_order():
    args = parse_args(["--devices", "2", "--cache-tables", "all"])
    config = parse_config(["--devices", "2", "--cache-tables", "all"])
    assert [f.name for f in dataclasses.fields(DlrmJobConfig)] == list(vars(args))
    assert config.as_json() == vars(args)  # args.json's "args", unchanged
    assert list(config.as_json()) == list(vars(args))


def test_fields_are_typed_and_frozen():
    assert all(f.type for f in dataclasses.fields(DlrmJobConfig))
    config = parse_config([])
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.devices = 8  # type: ignore[misc]
    assert dataclasses.replace(config, devices=8).devices == 8 and config.devices == 1


def test_replace_known_leaves_out_names_that_are_no_flag():
    # An older run's args.json may hold a flag the job no longer has.
    config = parse_config([]).replace_known({"embedding_dim": 8, "retired_flag": 3})
    assert config.embedding_dim == 8 and not hasattr(config, "retired_flag")
