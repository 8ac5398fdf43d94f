"""Runs that survive: the resume-until-done supervisor and multi-process setup."""
