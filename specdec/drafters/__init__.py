"""Draft sources, each behind the one small interface of `specdec.drafters.base.Drafter`."""
