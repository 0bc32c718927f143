"""Reserved for the FreeToken integration: the runtime patch (applied in every process, version-
and hash-checked), `doctor` (does this FreeToken install carry the patch and work), and the
builder that turns `pr_notes/<N>/` into a diff against FreeToken's source. Nothing is built yet;
the package exports no names."""
