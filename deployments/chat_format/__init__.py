"""Chat formats, shared by the Renderer, Ingress and the Slide room: templates, think markup, tool-call markups, reply parsing.

Rendering (the Renderer deployment, deployments/renderer/, wraps PromptRenderer and nothing more):
- template.py: ChatTemplate, a chat template compiled in jinja2's sandbox, rendering what transformers does.
- template_file.py: `--chat-template FILE`, read and compiled once at startup.
- conversation.py: messages normalised before the template sees them (system/developer rules, text parts).
- effort.py: the thinking toggle and reasoning effort as the template hears them.
- rendering.py: PromptRenderer, a chat request to prompt ids plus the ReplyFormat the reply will have
  (deployments/messages/render.py), and tokenize/detokenize.

Markup, one source each:
- think.py: the think families (`<think>`, Gemma 4's thought channel): opener, closer, what is derived from them.
- markups/: one file per tool-call family (glm.py, qwen_xml.py, hermes.py), each a ToolMarkup (base.py:
  how a template shows it, its call markers, parsing a call block, closing one an end token cut, the grammar
  of one call); the package is the registry (markup_for_template, markup_named). ReplyFormat.tool_format
  carries the family's name from the Renderer to Ingress.
- tool_calls.py: ParsedCall and the typing of argument values, shared by the families.

Replies (Ingress, and the Slide room's questions):
- reply_parser.py: ReplyParser/ReplyStream, a reply's text to reasoning, content and calls, whole or streamed.
- forced_calls.py: `tool_choice` "required" or a named function as a grammar over the family's calls.

Adding a tool-call family: write markups/<family>.py with a ToolMarkup subclass and put an instance in
markups.FAMILIES, ahead of any family its templates would also pass for. The parser, the forced-call grammar
and the Renderer need no change. docs/chat_formats.md describes the formats themselves.
"""
