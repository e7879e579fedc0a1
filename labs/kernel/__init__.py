"""The kernel lab: Debian's own kernel (`debian_kernel`), booted under QEMU (`qemu`) to run
one Python script (`harness.run_in_kernel`); scripts inside hand JSON back with
`guest.write_result`. tests/kernel and bench.ipvs use it (docs/kernel-tests.md)."""
