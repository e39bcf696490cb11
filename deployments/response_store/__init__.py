"""The ResponseStore deployment: stored Responses, shared by every Ingress replica."""
