"""Which tool-call markup a chat template teaches its model (the reply parser follows the template)."""

CALL_OPEN = "<tool_call>"
CALL_CLOSE = "</tool_call>"
GLM = "glm"  # <tool_call>name<arg_key>k</arg_key><arg_value>v</arg_value></tool_call>
QWEN_XML = "qwen_xml"  # <tool_call><function=name><parameter=k>v</parameter></function></tool_call>
HERMES = "hermes"  # <tool_call>{"name": ..., "arguments": {...}}</tool_call>


def format_of_template(source: str | None) -> str | None:
    """The call markup a chat template shows (None: the template shows no tool calls)."""
    if not source:
        return None
    if "<arg_key>" in source:
        return GLM
    if "<function=" in source:
        return QWEN_XML
    if CALL_OPEN in source:
        return HERMES
    return None
