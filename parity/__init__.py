"""Parity suite: fla_cula vs FLA 0.6.0 vs an fp64 reference, case by case.

    python -m parity            # full GPU grid, writes parity/REPORT_H200.md + parity/report_H200.json
    python -m parity --quick    # reduced GPU grid
    python -m parity --cpu      # references only (CI): fla_cula.reference vs FLA's naive CPU references

Modules: ``cases`` (the case grid and input generation), ``rules`` (tolerances and the pass rule),
``runner`` (runs one case on the GPU), ``report`` (markdown / JSON), ``cpu`` (the CPU mode).
"""
