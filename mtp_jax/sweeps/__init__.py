"""Sweeps: sweep files and run plans (sweep), the process scheduler, and the scaling analysis
(results, power-law fits, the MTP gain table)."""
