"""Input corpora shared by the unit, fuzz and e2e tests.

`hostile`: malformed and hostile Service / EndpointSlice / Endpoints / Node objects, each
with the skip reasons the agent must record for it. `pipeline`: decode -> model -> every
renderer, and the checks that what the renderers produce is valid kernel input.
"""
