"""RULER's five essay-haystack NIAH tasks over a public-domain haystack (`*_pd`), and the
`ruler_offline` group of the eleven RULER tasks that run without a download."""
