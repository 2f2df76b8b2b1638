"""Schedules: TIR kernels and their schedules per target."""
