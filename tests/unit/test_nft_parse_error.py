"""How NftRunner reads nft's error output (pure): the line that failed, trimmed, and how
many more there were. The runner against the kernel: tests/e2e/test_nft_runner.py."""

from __future__ import annotations

from proxy.dataplane.nftables.runner import parse_error


def test_parse_error_names_the_line_and_trims() -> None:
    text = "add table ip t\nadd chain ip t a\nadd rule ip t a bogus\n"
    err = parse_error("/dev/stdin:3:17-21: Error: syntax error, unexpected string\n"
                      "add rule ip t a bogus\n                ^^^^^\n", text)
    assert (str(err), err.line, err.offending) == (
        "line 3: syntax error, unexpected string", 3, "add rule ip t a bogus")
    many = "".join(f"/dev/stdin:{n}:1-3: Error: Could not process rule: No such file or "
                   f"directory\nadd\n^^^\n" for n in range(2, 10))
    err = parse_error(many, text)
    assert err.line == 2 and str(err).endswith("and 3 more errors")
    assert str(err).count("Could not process rule") == 5
    err = parse_error("Error: No such file or directory\nlist table ip x\n          ^\n", "x")
    assert (str(err), err.line, err.offending) == ("No such file or directory", None, None)
    assert str(parse_error("", "x")) == "nft failed and said nothing"
