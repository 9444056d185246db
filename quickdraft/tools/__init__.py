"""The user's tools over the Python API: `quickdraft check` (is the output really the target's?) and `quickdraft
tune` (which draft and K pay on my prompts?). Faces, like bench/: they import the API, nothing imports them."""
